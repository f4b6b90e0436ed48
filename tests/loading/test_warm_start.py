"""Warm starts: the persistent compilation cache (hit on a second run; off with the flag or the environment
variable) and the default model's cached conversion (the same tokens as reading the GGUF; a killed or broken
conversion never used), in a fresh cache folder of their own."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.loading import default_conversion
from mtp_jax.loading.default_model import GGUF_ENV
from mtp_jax.loading.text_tokenizer import TextTokenizer
from mtp_jax.params.open_source import open_source
from mtp_jax.params.state_file import STATE_FILE, read_state, write_state
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.cache_folder import CACHE_ENV
from tests.support.commands import ROOT
from tests.support.tiny_models import tiny_config

pytestmark = pytest.mark.slow  # the real default model, in fresh processes

PROMPT = "Explain speculative decoding in one paragraph."


def decode(env: dict, tmp_path, name: str, *extra: str) -> tuple[str, str, dict]:
    """(stdout, stderr, stats) of the README's command in a fresh process (8 tokens)."""
    stats = tmp_path / f"{name}.json"
    command = [sys.executable, "-m", "mtp_jax.decode", "--prompt", PROMPT, "--max-new-tokens", "8"]
    done = subprocess.run([*command, "--stats-json", str(stats), *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr, json.loads(stats.read_text())


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm2_path) -> dict:
    """The environment of a fresh cache folder, and the first run's output in it."""
    folder = tmp_path_factory.mktemp("mtp_jax_cache")
    env = {k: v for k, v in os.environ.items() if k not in (compile_cache.OFF_ENV, "JAX_COMPILATION_CACHE_DIR")}
    env.update({CACHE_ENV: str(folder), GGUF_ENV: smollm2_path})
    out, err, stats = decode(env, folder, "first")
    return {"env": env, "folder": folder, "first": (out, err, stats)}


def test_second_run_reads_both_caches_and_gives_the_same_tokens(cache):
    out, err, stats = cache["first"]
    assert "converting the default model once" in err and not stats["compile_from_cache"]
    assert stats["load_seconds"] > 0 and "from the cache" not in err
    again, err, stats = decode(cache["env"], cache["folder"], "second")
    assert "converting" not in err
    assert stats["compile_from_cache"] and "compile" in err and "(from the cache)" in err
    assert again == out and json.loads(out)["num_tokens"] == 8


def test_whole_programs_are_kept_compiled_afresh(cache):
    """The decode loop is kept whole (`executable_cache`), so a warm run skips tracing too. With it gone and JAX's
    own cache still holding the loop, the run compiles it afresh: an executable JAX read from its cache, kept
    again, failed in the next process ("Function ... not found")."""
    executables = cache["folder"] / "executables"
    assert [p.name.startswith("generate-") for p in executables.iterdir()] == [True]
    for path in executables.iterdir():
        path.unlink()
    out, _, stats = decode(cache["env"], cache["folder"], "rebuilt")
    assert not stats["compile_from_cache"] and len(os.listdir(executables)) == 1 and out == cache["first"][0]
    out, _, stats = decode(cache["env"], cache["folder"], "read")
    assert stats["compile_from_cache"] and out == cache["first"][0]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_compile_cache_off(cache, how):
    xla = cache["folder"] / "xla"
    before = sorted(os.listdir(xla))
    env = {**cache["env"], compile_cache.OFF_ENV: "1"} if how == "env" else cache["env"]
    out, _, stats = decode(env, cache["folder"], how, *(["--no-compile-cache"] if how == "flag" else []))
    assert not stats["compile_from_cache"] and sorted(os.listdir(xla)) == before
    assert out == cache["first"][0]


def params_of(model) -> dict:
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}


def test_killed_and_broken_conversions_are_not_used(cache, monkeypatch, capsys, smollm2_path):
    monkeypatch.setenv(CACHE_ENV, str(cache["folder"]))
    monkeypatch.setenv(GGUF_ENV, smollm2_path)
    folder = default_conversion.cached_folder(smollm2_path, np.float32)
    parent, name = os.path.split(folder)
    killed = os.path.join(parent, f".{name}.partial-0123abcd")  # what a conversion killed mid-write leaves
    os.makedirs(killed)
    with open(os.path.join(killed, STATE_FILE), "wb") as f:
        f.write(b"\0" * 100)
    with open(os.path.join(folder, STATE_FILE), "r+b") as f:  # the cached folder itself damaged: cut short
        f.truncate(1000)

    converted, first_tokenizer = default_conversion.load_default(np.float32, None)  # from the GGUF, written again
    assert "cannot be used" in capsys.readouterr().err
    assert not os.path.exists(killed)
    cached, fast_tokenizer = default_conversion.load_default(np.float32, None)
    assert "converting" not in capsys.readouterr().err
    assert isinstance(first_tokenizer, TextTokenizer) and isinstance(fast_tokenizer, TextTokenizer)  # every run's
    a, b = params_of(converted), params_of(cached)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    tokenizer = open_source(smollm2_path).load_tokenizer()  # transformers' own, from the GGUF
    texts = [PROMPT, "  Ünïcode — spaces\tand\nlines  ", "<|im_start|>user\nhi<|im_end|>", "x" * 50]
    for text in texts:
        chat = [{"role": "user", "content": text}]
        assert fast_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        assert fast_tokenizer.apply_chat_template(chat) == ids
        assert fast_tokenizer.apply_chat_template(chat, return_dict=True) == {"input_ids": ids}
    ids = [1, *fast_tokenizer(texts[1])["input_ids"], 2, 0, 40, 28120]
    for skip in (True, False):
        assert fast_tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_state_file_round_trip_in_place(tmp_path, dtype):
    """Every parameter back equal, bfloat16 too; on CPU the aligned ones used in the mapped file (no copy)."""
    cfg = tiny_config(vocab=30)  # sizes that are not all multiples of 64 bytes: some tensors go unaligned
    model = mtp_jax.CausalLM(cfg, dtype=np.dtype(dtype), rngs=nnx.Rngs(0))
    params = {tuple(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}
    path = str(tmp_path / STATE_FILE)
    write_state(path, params)
    nested = read_state(path, cfg, np.dtype(dtype), None)
    restored = {key: functools.reduce(lambda node, name: node[name], key, nested) for key in params}
    assert jax.tree.structure(nested).num_leaves == len(params)
    with open("/proc/self/maps") as f:  # the address ranges this process maps the file at
        ranges = [[int(a, 16) for a in line.split()[0].split("-")] for line in f if line.rstrip().endswith(path)]
    in_place = 0
    for key, value in params.items():
        assert restored[key].dtype == value.dtype and np.array_equal(np.asarray(restored[key]), value), key
        in_place += any(a <= restored[key].unsafe_buffer_pointer() < b for a, b in ranges)
    aligned = sum(v.nbytes % 64 == 0 for v in params.values())
    assert jax.default_backend() != "cpu" or in_place >= aligned > 0


def test_the_command_line_imports_neither_ipython_nor_orbax():
    """Startup time: flax is imported without IPython (mtp_jax/runtime/flax_import.py) and orbax only where a folder is
    written or read; IPython, where installed, still imports afterwards."""
    probe = (
        "import sys, importlib.util, mtp_jax.cli.decode\n"
        "print(sorted(m for m in ('IPython', 'orbax.checkpoint') if m in sys.modules))\n"
        "if importlib.util.find_spec('IPython'):\n"
        "    import IPython\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "ok"]
