"""Qwen3.5 (VLM wrapper), Qwen3.5-MoE and Qwen3-Next trunks against transformers on tiny random checkpoints in the
released layouts with an MTP layer added: conversion accounting, full logits, greedy tokens (plain and with MTP
drafts)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import mtp_jax
from mtp_jax.conversion.convert import plan_conversion
from mtp_jax.families.registry import model_config_from_hf
from mtp_jax.models.cache_attention import ATTENTION_CHUNK
from mtp_jax.params.open_source import open_source
from mtp_jax.params.tree import abstract_params
from tests.support.hybrid_models import FAMILIES, TEXT, save_with_mtp_layer
from tests.support.parity_helpers import hf_greedy
from tests.support.prompts import random_tokens

NEW_TOKENS = 24
PROMPT_LENS = (5, 9)
VOCAB = TEXT["vocab_size"]


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # conftest.py


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, transformers model of the trunk, our model loaded from the folder, the folder, per-expert names
    fused into gate_up_proj)."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    hf, fused = save_with_mtp_layer(family, folder)
    return family, hf, mtp_jax.load_model(str(folder), dtype=jnp.float32), folder, fused


def test_config_and_accounting(pair):
    family, _, model, folder, fused = pair
    cfg = model.config
    saved = json.loads((folder / "config.json").read_text())
    assert cfg == model_config_from_hf(saved) and cfg.family == family and cfg.has_mtp
    (segment,) = cfg.segments()  # one scanned group (DeltaNet, gated attention) x 2
    assert segment.count == 2 and [k.attention for k in segment.kinds] == ["deltanet", "gated"]
    assert cfg.mtp_layer_kind.attention == "gated" and cfg.rotary_dim == TEXT["head_dim"] // 4
    source = open_source(str(folder))
    names = source.tensor_names()
    plan = plan_conversion(cfg, abstract_params(cfg, jnp.float32), names)
    assert len(plan.targets) + len(plan.ignored) == len(names)
    assert all(n.startswith("mtp.") for n in names if "mtp" in n) and sum(n.startswith("mtp.") for n in plan.targets)
    if family == "qwen3_5":
        assert plan.ignored and all(n.startswith("model.visual.") for n in plan.ignored)
    else:
        assert not plan.ignored
    if family == "qwen3_5_moe_text":
        assert fused and not set(fused) & set(names) and "mtp.layers.0.mlp.experts.0.gate_proj.weight" in plan.targets


def test_full_logits(pair):
    _, hf, model, _, _ = pair
    ids = random_tokens(0, (2, 12), VOCAB)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids).long()).logits.numpy()
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    lengths = jnp.full((2,), ids.shape[1])
    hidden, _ = model.trunk(jnp.asarray(ids), positions, model.new_cache(2, 16), lengths=lengths)
    np.testing.assert_allclose(np.asarray(model.logits(hidden)), ref, atol=2e-4, rtol=2e-4)


def test_logits_after_a_long_cache(pair):
    """A prefill of 290 tokens into a cache of two attention chunks, then a block of 6: the gated attention layers
    read the cache chunk by chunk, in place; against transformers' logits over the whole sequence."""
    _, hf, model, _, _ = pair
    prefix, block, slots = 290, 6, 2 * ATTENTION_CHUNK
    ids = random_tokens(2, (2, prefix + block), VOCAB)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids).long()).logits.numpy()[:, prefix:]
    cache = model.new_cache(2, slots)
    positions = jnp.broadcast_to(jnp.arange(prefix + block), ids.shape)
    _, cache = model.trunk(jnp.asarray(ids[:, :prefix]), positions[:, :prefix], cache, lengths=jnp.full((2,), prefix))
    hidden, _ = model.trunk(jnp.asarray(ids[:, prefix:]), positions[:, prefix:], cache, lengths=jnp.full((2,), block))
    np.testing.assert_allclose(np.asarray(model.logits(hidden)), ref, atol=5e-4, rtol=5e-4)


def test_greedy_tokens(pair):
    """Right-padded prompts of different lengths, plain (and with 2 drafts from the converted MTP layer: its MoE
    experts per expert while the trunk's are fused), against transformers' greedy generate of each prompt alone."""
    family, hf, model, _, _ = pair
    prompts = random_tokens(1, (len(PROMPT_LENS), max(PROMPT_LENS)), VOCAB)
    lens = np.array(PROMPT_LENS, np.int32)
    expected = [hf_greedy(hf, prompts[row, :n], NEW_TOKENS) for row, n in enumerate(PROMPT_LENS)]
    for k in (0, 2) if family == "qwen3_5_moe_text" else (0,):
        cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=NEW_TOKENS, stop_on_eos=False)
        out = mtp_jax.generate(model, prompts, lens, jax.random.key(0), cfg)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.stack(expected), err_msg=f"k={k}")
