"""llama.cpp as a bench peer, through a stand-in `llama_cpp` module (llama-cpp-python is never a test dependency):
which rows it joins, the token ids it is given, and that every timed call prefills its whole prompt."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from mtp_jax.bench import main as bench_main
from mtp_jax.bench_peers import llama_cpp_available


class FakeLlama:
    """Greedy decoding stand-in: token i after a prompt is (sum of the prompt + i) % 97; records each call."""

    instances: list = []

    def __init__(self, model_path: str, **settings):
        self.model_path, self.settings, self.prompts, self.fresh = model_path, settings, [], False
        FakeLlama.instances.append(self)

    def reset(self):
        self.fresh = True

    def generate(self, tokens, **sampling):
        assert self.fresh, "a call reused the previous call's cache"
        assert sampling["temp"] == 0.0
        self.fresh = False
        self.prompts.append(list(tokens))
        i = 0
        while True:
            yield (sum(tokens) + i) % 97
            i += 1


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    module.Llama = FakeLlama
    FakeLlama.instances = []
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return module


def test_available_only_for_a_gguf_with_the_module(fake_llama_cpp, monkeypatch):
    assert llama_cpp_available("m.gguf")
    assert not llama_cpp_available("folder") and not llama_cpp_available(None)
    monkeypatch.delitem(sys.modules, "llama_cpp")
    monkeypatch.setattr(sys, "path", [])  # nothing importable
    assert not llama_cpp_available("m.gguf")


def test_llama_cpp_joins_the_batch_one_rows(fake_llama_cpp, smollm2_path, tmp_path, capsys):
    out = tmp_path / "b.json"
    code = bench_main([
        "--model", smollm2_path, "--batch-sizes", "1,2", "--num-draft", "0", "--max-new-tokens", "4",
        "--repeats", "2", "--no-split", "--json", str(out),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["impl"], r["batch"]) for r in rows if r["impl"] not in ("mtp_jax", "mtp_jax adaptive")] == [
        ("transformers", 1), ("llama.cpp", 1), ("transformers", 2)
    ]  # fmt: skip
    llama_row = next(r for r in rows if r["impl"] == "llama.cpp")
    assert llama_row["generated_tokens"] == 4 and llama_row["tokens_per_second"] > 0
    assert llama_row["same_tokens"] is False  # the stand-in's tokens are not the model's
    (llm,) = FakeLlama.instances
    assert llm.model_path == smollm2_path
    assert len(llm.prompts) == 1 + 2  # the warm-up and two timed sweeps, each from a fresh cache
    assert llm.prompts[0] == llm.prompts[-1] and len(llm.prompts[0]) > 4  # the same encoded prompt ours decodes
    assert any("llama.cpp runs at batch 1 only" in note for note in result["meta"]["notes"])
    assert "| llama.cpp (sequential cache) | 1 |" in capsys.readouterr().out
