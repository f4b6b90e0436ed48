"""llama.cpp as a bench peer, through a stand-in `llama_cpp` module (llama-cpp-python is never a test dependency):
which rows it joins, the token ids it is given, and that every timed call prefills its whole prompt."""

from __future__ import annotations

import argparse
import importlib.machinery
import sys
import types
import typing

import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.bench.peers import LlamaCppRun, llama_cpp_available
from mtp_jax.cli import bench
from mtp_jax.plan.shapes import SHAPES


class FakeLlama:
    """Greedy decoding stand-in: token i after a prompt is (sum of the prompt + i) % 97; records each call."""

    instances: typing.ClassVar[list] = []

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


def bench_args(*extra: str) -> argparse.Namespace:
    return bench.build_parser().parse_args(["--max-new-tokens", "4", "--repeats", "2", "--no-split", *extra])


def test_llama_cpp_joins_the_batch_one_rows_only(fake_llama_cpp):
    prompts = [types.SimpleNamespace(token_ids=[5, 6, 7, 8, 9]), types.SimpleNamespace(token_ids=[3, 4, 5])]
    notes = []
    llama = bench.llama_cpp_peer(bench_args(), "m.gguf", prompts, notes)
    assert llama.model_path == "m.gguf" and llama.settings["n_ctx"] >= 5 + 4
    assert any("llama.cpp runs at batch 1 only" in note for note in notes)
    assert [name for name, _ in bench.peer_runs(bench_args(), prompts[:1], None, llama)] == ["llama.cpp"]
    assert bench.peer_runs(bench_args(), prompts, None, llama) == []
    assert bench.llama_cpp_peer(bench_args("--temperature", "0.7"), "m.gguf", prompts, notes) is None
    assert bench.llama_cpp_peer(bench_args(), "folder", prompts, notes) is None


@pytest.mark.slow
def test_a_llama_cpp_row_beside_ours():
    """Its row from the fastest of the interleaved runs; every call decodes the prompt's own ids from a fresh cache."""
    model = mtp_jax.CausalLM(SHAPES["tiny"](), rngs=nnx.Rngs(0))
    prompt = [11, 12, 13, 14]
    ids, lens = np.asarray([[*prompt, 0, 0, 0, 0]], np.int32), np.asarray([4], np.int32)  # [1, 8], [1]
    llm = FakeLlama("m.gguf")
    run = LlamaCppRun(llm, [types.SimpleNamespace(token_ids=prompt)], 4)
    results = bench.time_batch(bench_args(), model, ids, lens, [0], None, [("llama.cpp", run)])
    (ours, _), (row, tokens) = results
    assert ours["impl"] == "mtp_jax" and row["impl"] == "llama.cpp" and "cache" not in row
    assert tokens.tolist() == [[(sum(prompt) + i) % 97 for i in range(4)]]
    assert row["generated_tokens"] == 4 and row["tokens_per_second"] > 0 and len(row["walls"]) == 2
    assert llm.prompts == [prompt] * 3  # the warm-up and two timed sweeps


def test_a_llama_cpp_that_does_not_import_is_no_peer_and_is_noted(fake_llama_cpp, monkeypatch):
    """llama-cpp-python installed without its dependencies (its import fails inside): the bench goes on without it."""

    def broken(path, context):
        raise ModuleNotFoundError("No module named 'diskcache'")

    monkeypatch.setattr(bench, "load_llama_cpp", broken)
    notes = []
    args = argparse.Namespace(temperature=0.0, max_new_tokens=4)
    prompt = types.SimpleNamespace(token_ids=[1, 2, 3])
    assert bench.llama_cpp_peer(args, "m.gguf", [prompt], notes) is None
    assert notes == ["llama.cpp not timed: llama_cpp does not import (No module named 'diskcache')"]
