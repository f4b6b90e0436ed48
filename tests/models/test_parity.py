"""Parity with transformers' PyTorch models on tiny random checkpoints: block by block, full logits, greedy tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import mtp_jax
from mtp_jax.config.model import RopeConfig
from mtp_jax.families.registry import model_config_from_hf
from tests.support.long_cache import check_logits_after_a_long_cache
from tests.support.parity_helpers import (
    check_block_by_block,
    check_full_logits,
    check_greedy_batch,
    hf_greedy,
    save_and_load,
)
from tests.support.prompts import padded_prompts, random_tokens

TOL = dict(atol=1e-5, rtol=1e-5)
NEW_TOKENS = 24
PROMPT_LENS = (5, 12, 9)  # generation prompts, right-padded to a common width
LOGITS_LEN = 12  # the unpadded batch of 3 for the block and logits checks
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    eos_token_id=None,  # generate the full budget on both sides
    bos_token_id=None,
)
VOCAB = SHAPE["vocab_size"]
CASES = {
    "llama-mha": (LlamaConfig, dict(num_key_value_heads=4)),
    "llama-gqa": (LlamaConfig, dict(num_key_value_heads=2)),
    "llama-gqa-tied": (LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3-rope": (LlamaConfig, dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    "llama-bias": (LlamaConfig, dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "qwen2": (Qwen2Config, dict(num_key_value_heads=2)),
    "qwen3": (Qwen3Config, dict(num_key_value_heads=2, head_dim=32)),
}


def _randomize(model: torch.nn.Module) -> None:
    """Non-degenerate weights: every parameter ~ N(0, 0.1), norm scales ~ N(1, 0.1), so each one matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # conftest.py


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved folder, the saved config.json dict)."""
    config_cls, extra = CASES[request.param]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra), attn_implementation="eager")
    _randomize(hf)
    model, saved = save_and_load(hf.float().eval(), tmp_path_factory.mktemp(request.param))
    return hf, model, saved


def test_config_round_trips(pair):
    hf, model, saved = pair
    cfg, ref = model.config, hf.config
    assert cfg == model_config_from_hf(saved)
    assert cfg.family == ref.model_type
    assert (cfg.num_heads, cfg.num_kv_heads) == (ref.num_attention_heads, ref.num_key_value_heads)
    assert cfg.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    assert cfg.qk_norm == (ref.model_type == "qwen3")
    assert cfg.eos_token_ids == ()
    assert cfg.rope.theta == ref.rope_parameters["rope_theta"]
    assert cfg.rope.kind == ref.rope_parameters["rope_type"]
    if cfg.rope.kind == "llama3":
        assert saved["rope_parameters"]["rope_type"] == "llama3"
        assert cfg.rope == RopeConfig(
            theta=500000.0,
            kind="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )


def test_legacy_rope_scaling_maps_like_rope_parameters():
    """transformers 4.x wrote `rope_scaling` with a top-level `rope_theta`; both spellings give one RopeConfig."""
    base = {k: v for k, v in LlamaConfig(**SHAPE).to_dict().items() if k != "rope_parameters"}
    legacy = dict(base, rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    current = dict(base, rope_parameters=LLAMA3_ROPE)
    assert model_config_from_hf(legacy).rope == model_config_from_hf(current).rope
    assert model_config_from_hf(current).rope.kind == "llama3"


def test_block_by_block(pair):
    """Each stage fed transformers' own input: embedding, rotary tables, every layer, final norm, lm_head."""
    hf, model, _ = pair
    check_block_by_block(hf, model, random_tokens(1, (3, LOGITS_LEN), VOCAB), TOL)


def test_full_logits(pair):
    hf, model, _ = pair
    check_full_logits(hf, model, random_tokens(2, (3, LOGITS_LEN), VOCAB), TOL)


def test_logits_after_a_long_cache(pair):
    """Blocks over a cache of two attention chunks (the chunked pass), one past the first chunk, one over stale
    slots (tests/support/long_cache.py)."""
    hf, model, _ = pair
    check_logits_after_a_long_cache(hf, model, random_tokens(4, (2, 300), VOCAB))


def test_greedy_tokens(pair):
    """Batch 1, then 3 right-padded prompts of different lengths together; transformers runs each alone."""
    hf, model, _ = pair
    ids = padded_prompts(3, PROMPT_LENS, VOCAB)
    references = [hf_greedy(hf, ids[b, :n], NEW_TOKENS) for b, n in enumerate(PROMPT_LENS)]
    assert all(len(r) == NEW_TOKENS for r in references)
    cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=NEW_TOKENS)

    single = mtp_jax.generate(model, ids[:1], np.asarray(PROMPT_LENS[:1]), jax.random.key(0), cfg)
    assert np.asarray(single.tokens[0]).tolist() == references[0]
    assert int(single.lengths[0]) == NEW_TOKENS

    check_greedy_batch(model, ids, PROMPT_LENS, references, NEW_TOKENS)
