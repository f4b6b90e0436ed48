"""Text in, text out: `generate_text` turns a list of prompts into answers, batching and padding them as
`python -m mtp_jax.decode` does; the command runs its batches through `decode_batches` too.

Prompts are tokenized (through the chat template when the tokenizer has one, unless `chat=False`). Up to
`batch_size` of them decode as one batch of `generate`, right-padded to a bucketed width (`prompts.bucket`: few
shapes, few compiles). More go through an `Engine` of `batch_size` slots: a row whose answer ends takes the next
prompt at once, rather than idling until the longest answer of its batch ends. Each row draws from its own stream,
`fold_in(key(seed), prompt index)`, whatever batch or slot it lands in.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode import default_drafting, memory, speculative, stats
from mtp_jax.decode.engine import Engine, Request
from mtp_jax.decode.prompts import Prompt, bucket, encode_prompts, pad_batch
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.kv_cache import cache_slots
from mtp_jax.parallel.sharding import to_host
from mtp_jax.quant.int8_activations import has_int8_activations
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.errors import UserError


@dataclasses.dataclass(frozen=True)
class TextResult:
    """One prompt's answer."""

    index: int  # the prompt's place in the input
    prompt: str | list[int]  # as given: text, or token ids
    text: str  # the generated tokens decoded, special tokens skipped ("" without a tokenizer)
    token_ids: list[int]  # the generated ids only (EOS included when it ended the row)
    finish_reason: str  # "eos" or "length"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def row(self) -> dict:
        """The output row of `python -m mtp_jax.decode` (its JSONL fields, in their order)."""
        return {"index": self.index, "prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
                "num_tokens": self.num_tokens, "finish_reason": self.finish_reason}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TextOutput:
    """`generate_text`'s answers, in input order, and the statistics of the whole call."""

    results: list[TextResult]
    stats: dict  # the fields of decode's --stats-json: rounds, acceptance, tokens/s, compile seconds, ...

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.results]


def generate_text(
    model: CausalLM,
    prompts: Sequence[str | Sequence[int]],
    cfg: DecodeConfig | None = None,
    *,
    tokenizer=None,
    chat: bool = True,
    batch_size: int = 8,
    seed: int = 0,
) -> TextOutput:
    """Answers to `prompts` (strings, or lists of token ids used exactly as given) from `model`.

    `cfg`: drafts, budget and sampling (default: `DecodeConfig()` with the drafting that pays on this device,
    `mtp_jax.decode.default_drafting`: adaptive from round costs measured once on a CPU; none without an MTP head).
    `tokenizer`: the model's, as `mtp_jax.load` returns it beside the model; needed for text prompts, and for the
    answers' text. `chat`: put text prompts through the tokenizer's chat template when it has one. `batch_size`:
    rows per `generate` call (raised to a multiple of the mesh's `data` size on a sharded model). `seed`: the
    sampling streams' seed (unused when greedy).
    """
    items = checked_prompts(prompts)
    given, cfg = cfg, checked_config(model, cfg)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    cfg_model = model.config
    encoded = encode_prompts(
        items, tokenizer, chat=chat, vocab_size=cfg_model.vocab_size, context=cfg_model.max_position_embeddings
    )
    rows = batch_rows(model, batch_size, len(encoded))
    check_budget(model, encoded, cfg, rows)
    drafting = None
    if given is None and model.config.has_mtp:
        drafting = default_drafting.choose(
            model, *first_batch(encoded, rows), cfg.invariant or has_int8_activations(model)
        )
        cfg = default_drafting.apply(cfg, drafting)
    results: list[TextResult] = []
    summary = decode_batches(model, tokenizer, encoded, cfg, rows, row_sampling(cfg, seed), results.extend)
    return TextOutput(results, summary if drafting is None else {**summary, "drafting": drafting.reason})


def first_batch(prompts: list[Prompt], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The first batch `decode_batches` will decode, padded as it pads it: ids [B, W], lens [B]."""
    batch = prompts[:batch_size]
    return pad_batch(batch, batch_size, bucket(max(len(p.token_ids) for p in batch)))


def checked_config(model: CausalLM, cfg: DecodeConfig | None) -> DecodeConfig:
    """`cfg`, or the default for `model` (3 drafts with an MTP head, else none: `generate_text` then chooses the
    drafting for the device); a wrong one refused in one line."""
    cfg = cfg if cfg is not None else DecodeConfig(num_draft=3 if model.config.has_mtp else 0)
    if not isinstance(cfg, DecodeConfig):
        raise UserError(f"cfg must be a DecodeConfig, got {type(cfg).__name__}")
    if cfg.num_draft and not model.config.has_mtp:
        raise UserError("this model has no MTP head: use DecodeConfig(num_draft=0)")
    return cfg


def checked_prompts(prompts) -> list[str | list[int]]:
    """`prompts` as a list of strings and lists of ints; anything else is refused in one line."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise UserError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}"
                        + (" (put one prompt in a list)" if isinstance(prompts, str) else ""))  # fmt: skip
    if not prompts:
        raise UserError("prompts is empty: nothing to generate")
    items = []
    for i, item in enumerate(prompts):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, Sequence) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                 for t in item):  # fmt: skip
            items.append([int(t) for t in item])
        else:
            raise UserError(f"prompt {i} must be a string or a list of token ids, got {type(item).__name__}")
    return items


def batch_rows(model: CausalLM, batch_size: int, num_prompts: int) -> int:
    """Rows per batch: `batch_size`, no more than the prompts, rounded up to a multiple of the mesh's data shards
    (each gets the same number of rows; padding repeats a row)."""
    rows = min(batch_size, num_prompts)
    if model.sharding_rules is not None:
        shards = model.sharding_rules.axis_size("batch")
        rows = -(-rows // shards) * shards
    return rows


def decode_batches(
    model: CausalLM,
    tokenizer,
    prompts: list[Prompt],
    cfg: DecodeConfig,
    batch_size: int,
    sampling_for: Callable,
    on_results: Callable[[list[TextResult]], None],
    progress: bool = False,
    refill: bool = True,
) -> dict:
    """Decode `prompts` `batch_size` rows at a time, handing results to `on_results` in input order as they finish;
    the statistics summary of the run. More prompts than rows go through slots that refill (`decode_in_slots`), or,
    `refill` off, batch after batch. `sampling_for`: prompt indices [B] -> (keys [B], SamplingParams or None), as
    `row_sampling` makes it. `progress`: a progress bar on stderr when there are several batches."""
    if refill and len(prompts) > batch_size:
        return decode_in_slots(model, tokenizer, prompts, cfg, batch_size, sampling_for, on_results, progress)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    compiled, compile_seconds, wall, counters, generated, read = {}, 0.0, 0.0, None, 0, 0  # read: from the cache
    for batch in tqdm(batches, desc="decoding", unit="batch", disable=len(batches) < 2 or not progress,
                      file=sys.stderr):  # fmt: skip
        width = bucket(max(len(p.token_ids) for p in batch))
        ids, lens = pad_batch(batch, batch_size, width)  # [B, width], [B]
        rows = np.asarray([p.index for p in batch] + [batch[0].index] * (batch_size - len(batch)))  # [B]
        keys, sampling = sampling_for(rows)
        if width not in compiled:
            start, (hits_before, misses_before) = time.perf_counter(), compile_cache.lookups()
            compiled[width] = speculative.compile_generate(model, ids, lens, keys, cfg, sampling)
            compile_seconds += time.perf_counter() - start
            hits_now, misses_now = compile_cache.lookups()
            read += hits_now > hits_before and misses_now == misses_before  # read, none compiled
        start = time.perf_counter()
        out = jax.block_until_ready(compiled[width](model, ids, lens, keys, cfg, sampling))
        wall += time.perf_counter() - start
        counters = stats.add(counters, out.stats)
        results = batch_results(batch, out, tokenizer)
        generated += sum(r.num_tokens for r in results)
        on_results(results)
    return stats.summarize(counters, num_draft=cfg.num_draft, tree=cfg.tree, generated_tokens=generated, wall=wall,
                           compile_seconds=compile_seconds, compile_from_cache=read == len(compiled))  # fmt: skip


def decode_in_slots(model: CausalLM, tokenizer, prompts: list[Prompt], cfg: DecodeConfig, slots: int,
                    sampling_for: Callable, on_results: Callable[[list[TextResult]], None],
                    progress: bool) -> dict:  # fmt: skip
    """`decode_batches` for more prompts than rows: an `Engine` of `slots` rows, each refilled with the next prompt
    as soon as its row is done. Results reach `on_results` in input order (a row waits for the rows before it)."""
    max_len = max(len(p.token_ids) for p in prompts) + cfg.max_new_tokens
    compile_before, lookups_before = compile_cache.compile_seconds(), compile_cache.lookups()
    start = time.perf_counter()
    engine = Engine(model, cfg, slots=slots, max_len=max_len)
    order = {}
    for prompt in prompts:
        keys, sampling = sampling_for(np.asarray([prompt.index]))
        settings = {} if sampling is None else {name: getattr(sampling, name)[0].item() for name in SAMPLING_FIELDS}
        request = Request(prompt.token_ids, cfg.max_new_tokens, key=keys[0], **settings)
        order[engine.submit(request)] = prompt
    generated, finished, tokens = 0, {}, {request_id: [] for request_id in order}
    position = {prompt.index: i for i, prompt in enumerate(prompts)}
    written = 0
    with tqdm(total=len(prompts), desc="decoding", unit="prompt", disable=not progress, file=sys.stderr) as bar:
        while engine.busy:
            for update in engine.step():
                tokens[update.request_id] += update.tokens
                if update.finished:
                    prompt = order[update.request_id]
                    ids = tokens.pop(update.request_id)
                    finished[position[prompt.index]] = text_result(prompt, ids, update.finish_reason, tokenizer)
                    generated += len(ids)
                    bar.update()
            ready = []
            while written in finished:
                ready.append(finished.pop(written))
                written += 1
            if ready:
                on_results(ready)
    wall = time.perf_counter() - start
    compile_seconds = compile_cache.compile_seconds() - compile_before
    hits, misses = (now - before for now, before in zip(compile_cache.lookups(), lookups_before, strict=True))
    summary = engine.summary(generated, wall - compile_seconds, compile_seconds)
    return {**summary, "compile_from_cache": hits > 0 and misses == 0}


SAMPLING_FIELDS = ("temperature", "top_k", "top_p")


def text_result(prompt: Prompt, generated: list[int], finish_reason: str, tokenizer) -> TextResult:
    """A prompt's result from its generated ids."""
    return TextResult(
        index=prompt.index,
        prompt=prompt.text if prompt.text is not None else list(prompt.token_ids),
        text=tokenizer.decode(generated, skip_special_tokens=True) if tokenizer else "",
        token_ids=generated,
        finish_reason=finish_reason,
    )


def batch_results(batch: list[Prompt], out: speculative.GenerateOutput, tokenizer) -> list[TextResult]:
    """The results of a batch's prompts from `generate`'s output (padding rows past them dropped)."""
    tokens, lengths, by_eos = (to_host(x) for x in (out.tokens, out.lengths, out.finished_by_eos))
    return [text_result(prompt, tokens[row, : lengths[row]].tolist(), "eos" if by_eos[row] else "length", tokenizer)
            for row, prompt in enumerate(batch)]  # fmt: skip


def row_sampling(cfg: DecodeConfig, seed: int, overrides: list[dict] | None = None) -> Callable:
    """A function of prompt indices [B] -> (one key per row [B], SamplingParams or None when every row is greedy).

    Rows sample with `cfg`'s temperature, top_k and top_p, or their prompt's `overrides` (a dict per prompt, as
    `prompts.read_prompt_records` reads them). A row's key is `key(seed)` of its override when it sets one, else
    `fold_in(key(seed), prompt index)`: every row has its own stream, whatever rows share its batch.
    """
    overrides = overrides or []
    defaults = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "seed": None}
    own = lambda index: overrides[index] if index < len(overrides) else {}
    value = lambda index, name: own(index).get(name, defaults[name])
    all_greedy = not any([o.get("temperature", cfg.temperature) for o in overrides] or [cfg.temperature])
    base_key = jax.random.key(seed)

    def for_rows(rows: np.ndarray):
        rows = [int(r) for r in rows]
        keys = jnp.stack([
            jax.random.key(value(r, "seed")) if value(r, "seed") is not None else jax.random.fold_in(base_key, r)
            for r in rows
        ])  # fmt: skip
        if all_greedy:
            return keys, None
        sampling = SamplingParams(
            temperature=jnp.asarray([value(r, "temperature") for r in rows], jnp.float32),
            top_k=jnp.asarray([value(r, "top_k") for r in rows], jnp.int32),
            top_p=jnp.asarray([value(r, "top_p") for r in rows], jnp.float32),
        )
        return keys, sampling

    return for_rows


def check_budget(model: CausalLM, prompts: list[Prompt], cfg: DecodeConfig, batch_size: int) -> None:
    """Refuse, before compiling, a budget past the model's context, or caches and parameters that cannot fit in the
    memory of a device (of the machine, on CPU)."""
    longest, context = max(len(p.token_ids) for p in prompts), model.config.max_position_embeddings
    if longest + cfg.max_new_tokens > context:
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens}: the longest prompt ({longest} tokens) and the budget "
                        f"take {longest + cfg.max_new_tokens} positions; the model's context is {context}")  # fmt: skip
    slots = cache_slots(bucket(longest), cfg)
    caches = jax.eval_shape(
        lambda: (model.new_cache(batch_size, slots), model.new_mtp_cache(batch_size, slots) if cfg.num_draft else ())
    )
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches))
    short = memory.shortfall(model, cache_bytes)
    if short is not None:
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens} with --batch-size {batch_size}: {short}")
