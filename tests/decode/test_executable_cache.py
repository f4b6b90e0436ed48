"""The cache of whole compiled programs (`executable_cache`): a program read back runs as the one compiled; a
different shape, setting or model compiles anew; a damaged file is compiled again; off unless the command-line
tools' caches are on. (A fresh process reading a program back: tests/loading/test_warm_start.py.)"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax.decode import executable_cache
from mtp_jax.decode.speculative import compile_generate, generate
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.cache_folder import CACHE_ENV
from tests.support.tiny_models import predictable_model

pytestmark = pytest.mark.slow

PROMPTS = np.array([[1, 5, 7, 2, 0, 0], [4, 4, 9, 0, 0, 0]], np.int32)
LENS = np.array([4, 3], np.int32)


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """The command-line tools' caches on, in a fresh folder: yields the executables' folder."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(compile_cache.OFF_ENV, raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    with compile_cache.active():
        yield tmp_path / "executables"


def compiled_tokens(model, cfg, prompts=PROMPTS, lens=LENS) -> tuple[np.ndarray, int]:
    """(tokens of the compiled program, programs read from a cache meanwhile)."""
    hits = compile_cache.lookups()[0]
    program = compile_generate(model, prompts, lens, jax.random.key(0), cfg)
    return np.asarray(program(model, prompts, lens, jax.random.key(0), cfg).tokens), compile_cache.lookups()[0] - hits


def test_a_program_read_back_runs_as_compiled(caches):
    model, cfg = predictable_model(), mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=6)
    plain = np.asarray(generate(model, PROMPTS, LENS, jax.random.key(0), cfg).tokens)
    first, hits = compiled_tokens(model, cfg)
    assert hits == 0 and len(os.listdir(caches)) == 1
    again, hits = compiled_tokens(model, cfg)
    assert hits == 1 and len(os.listdir(caches)) == 1
    np.testing.assert_array_equal(first, plain)
    np.testing.assert_array_equal(again, plain)


def test_another_shape_setting_or_model_compiles_anew(caches):
    model, cfg = predictable_model(), mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=6)
    compiled_tokens(model, cfg)
    others = [
        (model, cfg, np.pad(PROMPTS, ((0, 0), (0, 2))), LENS),  # a wider prompt
        (model, mtp_jax.DecodeConfig(num_draft=1, max_new_tokens=6), PROMPTS, LENS),  # another k
        (predictable_model(cfg=dataclasses.replace(model.config, num_layers=3)), cfg, PROMPTS, LENS),
    ]
    for count, (other, other_cfg, prompts, lens) in enumerate(others, start=2):
        tokens, hits = compiled_tokens(other, other_cfg, prompts, lens)
        plain = generate(other, prompts, lens, jax.random.key(0), other_cfg).tokens
        assert hits == 0 and len(os.listdir(caches)) == count
        np.testing.assert_array_equal(tokens, plain)


def test_a_damaged_file_is_compiled_again(caches):
    model, cfg = predictable_model(), mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=6)
    first, _ = compiled_tokens(model, cfg)
    (stored,) = caches.iterdir()
    stored.write_bytes(stored.read_bytes()[:1000])
    again, hits = compiled_tokens(model, cfg)
    assert hits == 0 and stored.stat().st_size > 1000
    np.testing.assert_array_equal(again, first)


def test_off_without_the_tools_caches(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model, cfg = predictable_model(), mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=6)
    compiled_tokens(model, cfg)
    with compile_cache.active(off=True):
        compiled_tokens(model, cfg)
    assert not os.path.exists(executable_cache.folder())
