"""The peers `python -m mtp_jax.bench` times beside ours, in the same process and on the same prompts: transformers'
PyTorch `generate` (on the GPU when ours runs on one) and, when `llama_cpp` (llama-cpp-python) is importable and the
model is a GGUF file, llama.cpp on the CPU. Each run is called like `bench.OursRun`: a call decodes once and returns
its wall seconds; `result(walls)` gives the row's fields and the generated tokens."""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import jax
import numpy as np


def per_round(wall: float, prefill: float, rounds: int) -> dict:
    """The prefill's ms and the decode loop's ms per round: the wall without the prefill, over the rounds (the
    fastest prefill and the fastest whole run, each of its own sweeps); None where the difference is lost in the
    timing noise (tiny models) or there are no rounds."""
    loop = wall - prefill
    return {"prefill_ms": 1000 * prefill, "ms_per_round": 1000 * loop / rounds if rounds and loop > 0 else None}


def peer_device() -> str:
    """Where transformers runs: on the GPU when ours does (and torch sees one), else on the CPU."""
    import torch  # heavy optional dependency, needed only for the peer

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def load_peer(path: str, dtype_name: str):
    """transformers' model of the same weights (a .gguf is dequantized by transformers itself), on `peer_device()`."""
    import torch  # heavy optional dependencies, needed only for the peer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, dtype_name)
    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(peer_device()).eval()


class PeerRun:
    """transformers' generate on a left-padded batch with its attention mask, static cache when it works, else
    dynamic; warmed up once untimed. Called like `OursRun`."""

    def __init__(self, model, prompts, max_new_tokens: int, temperature: float):
        import torch  # heavy optional dependency, needed only for the peer

        self.model, self.max_new_tokens = model, max_new_tokens
        self.width = width = max(len(p.token_ids) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, W]
        for row, p in enumerate(prompts):
            ids[row, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
        starts = torch.tensor([[width - len(p.token_ids)] for p in prompts])
        mask = (torch.arange(width)[None] >= starts).long().to(model.device)
        self.ids = ids.to(model.device)
        # eos_token_id=None: EOS is generated like any token but stops nothing (min_new_tokens would mask it instead).
        greedy = {"do_sample": False}
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else greedy
        self.kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                           **sampling)  # fmt: skip
        self.cache, self.prefill_walls = "static", []
        try:
            self()  # warm-up, not timed
        except Exception as e:  # this platform or version cannot run the static cache
            why = f"{type(e).__name__}: {e}"
            print(f"note: static cache failed for transformers ({why}); using dynamic", file=sys.stderr)
            self.cache = "dynamic"
            self()
        self.prefill_walls = []  # the warm-up's is not a measurement

    def __call__(self) -> float:
        import torch  # heavy optional dependency, needed only for the peer

        sync = torch.cuda.synchronize if self.model.device.type == "cuda" else lambda: None
        with torch.no_grad():
            start = time.perf_counter()
            self.model.generate(self.ids, cache_implementation=self.cache, **{**self.kwargs, "max_new_tokens": 1})
            sync()
            self.prefill_walls.append(time.perf_counter() - start)
            start = time.perf_counter()
            self.out = self.model.generate(self.ids, cache_implementation=self.cache, **self.kwargs)
            sync()
        return time.perf_counter() - start

    def result(self, walls: list[float]) -> tuple[dict, np.ndarray]:
        new, wall, steps = self.out[:, self.width :].cpu().numpy(), min(walls), self.max_new_tokens - 1  # [B, new]
        fields = {"cache": self.cache, "rounds": steps, "generated_tokens": int(new.size), "mean_accepted_length": 1.0,
                  "acceptance_rate": 0.0, "acceptance_per_position": [], "tokens_per_second": new.size / wall,
                  "wall_seconds": wall, "compile_seconds": None, "walls": walls,
                  **per_round(wall, min(self.prefill_walls), steps)}  # fmt: skip
        return fields, new


def llama_cpp_available(path: str | None) -> bool:
    """llama.cpp can be a peer: `path` is a GGUF file and llama-cpp-python is importable."""
    return bool(path) and path.endswith(".gguf") and importlib.util.find_spec("llama_cpp") is not None


def load_llama_cpp(path: str, context: int):
    """llama.cpp's model of the GGUF at `path`, its weights as the file stores them, on every CPU thread."""
    import llama_cpp  # optional: only when installed (never a dependency of this package)

    threads = os.cpu_count() or 1
    return llama_cpp.Llama(model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                           n_batch=context, verbose=False)  # fmt: skip


class LlamaCppRun:
    """llama.cpp's greedy decoding of each prompt in turn (its Python API decodes one sequence at a time), the same
    token ids in as ours, `max_new_tokens` out (EOS stops nothing); warmed up once untimed."""

    def __init__(self, llm, prompts, max_new_tokens: int):
        self.llm, self.max_new_tokens = llm, max_new_tokens
        self.prompts = [list(p.token_ids) for p in prompts]
        self.prefill_walls: list[float] = []
        self()  # warm-up, not timed
        self.prefill_walls = []

    def _decode(self, ids: list[int]) -> tuple[list[int], float]:
        """(generated ids, seconds to the first generated token)."""
        self.llm.reset()  # no prompt prefix reused from the last call: every call prefills its whole prompt
        start, out, first = time.perf_counter(), [], 0.0
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter() - start
            out.append(int(token))
            if len(out) == self.max_new_tokens:
                break
        return out, first

    def __call__(self) -> float:
        start, prefill, outs = time.perf_counter(), 0.0, []
        for ids in self.prompts:
            tokens, first = self._decode(ids)
            outs.append(tokens)
            prefill += first
        wall = time.perf_counter() - start
        self.prefill_walls.append(prefill)
        self.out = np.asarray(outs)  # [B, max_new_tokens]
        return wall

    def result(self, walls: list[float]) -> tuple[dict, np.ndarray]:
        wall, steps = min(walls), self.max_new_tokens - 1
        fields = {"rounds": steps * len(self.prompts), "generated_tokens": int(self.out.size),
                  "mean_accepted_length": 1.0, "acceptance_rate": 0.0, "acceptance_per_position": [],
                  "tokens_per_second": self.out.size / wall, "wall_seconds": wall, "compile_seconds": None,
                  "walls": walls, **per_round(wall, min(self.prefill_walls), steps * len(self.prompts))}  # fmt: skip
        return fields, self.out
