"""Parity with transformers' PyTorch models on tiny random checkpoints: block by block, full logits, greedy tokens."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import mtp_jax
from checkpoints_convert.hf_config import model_config_from_hf
from mtp_jax.cache import KVCache
from mtp_jax.config import RopeConfig
from tests.long_cache import check_logits_after_a_long_cache

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


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved folder, the saved config.json dict)."""
    config_cls, extra = CASES[request.param]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra), attn_implementation="eager")
    _randomize(hf)
    hf = hf.float().eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    with open(folder / "config.json") as f:
        saved = json.load(f)
    return hf, mtp_jax.load_model(str(folder), dtype=jnp.float32), saved


def _tokens(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SHAPE["vocab_size"], shape).astype(np.int32)


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


def _capture(hf) -> tuple[dict, list]:
    """Forward hooks recording the embedding, rotary tables, every layer's input/output and the final norm."""
    seen: dict = {"layer_in": {}, "layer_out": {}}
    inner = hf.model
    handles = [
        inner.embed_tokens.register_forward_hook(lambda m, a, out: seen.__setitem__("embed", out)),
        inner.rotary_emb.register_forward_hook(lambda m, a, out: seen.__setitem__("rope", out)),
        inner.norm.register_forward_hook(lambda m, a, out: seen.update(norm_in=a[0], norm_out=out)),
    ]
    for i, layer in enumerate(inner.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: seen["layer_in"].__setitem__(i, a[0])))
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: seen["layer_out"].__setitem__(i, out)))
    return seen, handles


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def test_block_by_block(pair):
    """Each stage fed transformers' own input: embedding, rotary tables, every layer, final norm, lm_head."""
    hf, model, _ = pair
    ids = _tokens(1, (3, LOGITS_LEN))
    seen, handles = _capture(hf)
    try:
        with torch.no_grad():
            logits = hf(torch.from_numpy(ids).long()).logits
    finally:
        for h in handles:
            h.remove()

    positions = jnp.broadcast_to(jnp.arange(LOGITS_LEN), ids.shape)
    rope = model.rope(positions)
    chex.assert_trees_all_close(model.embed_tokens(ids), _np(seen["embed"]), **TOL)
    chex.assert_trees_all_close(tuple(a[:1] for a in rope), tuple(_np(t) for t in seen["rope"]), **TOL)  # [1, T, H]
    graphdef, stacked = nnx.split(model.layers.layers)
    cfg = model.config
    zeros = jnp.zeros((3, LOGITS_LEN, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    for i in range(cfg.num_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
        out, _, _ = layer(_np(seen["layer_in"][i]), positions, rope, zeros, zeros)
        chex.assert_trees_all_close(out, _np(seen["layer_out"][i]), **TOL, custom_message=f"layer {i}")
    chex.assert_trees_all_close(model.final_norm(_np(seen["norm_in"])), _np(seen["norm_out"]), **TOL)
    chex.assert_trees_all_close(model.logits(_np(seen["norm_out"])), _np(logits), **TOL)


def test_full_logits(pair):
    hf, model, _ = pair
    ids = _tokens(2, (3, LOGITS_LEN))
    positions = jnp.broadcast_to(jnp.arange(LOGITS_LEN), ids.shape)
    cache = KVCache.zeros(model.config.num_layers, 3, LOGITS_LEN, model.config, jnp.float32)
    hidden, _ = model.trunk(ids, positions, cache)
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids).long()).logits
    chex.assert_trees_all_close(model.logits(hidden), _np(reference), **TOL)


def test_logits_after_a_long_cache(pair):
    """Blocks over a cache of two attention chunks (the chunked pass), one past the first chunk, one over stale
    slots (tests/long_cache.py)."""
    hf, model, _ = pair
    check_logits_after_a_long_cache(hf, model, _tokens(4, (2, 300)))


def _hf_greedy(hf, prompt: np.ndarray) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.from_numpy(prompt).long()[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens(pair):
    """Batch 1, then 3 right-padded prompts of different lengths together; transformers runs each alone."""
    hf, model, _ = pair
    width = max(PROMPT_LENS)
    ids = _tokens(3, (len(PROMPT_LENS), width))
    prompts = [ids[b, :n] for b, n in enumerate(PROMPT_LENS)]
    ids = np.where(np.arange(width) < np.asarray(PROMPT_LENS)[:, None], ids, 0)
    references = [_hf_greedy(hf, p) for p in prompts]
    assert all(len(r) == NEW_TOKENS for r in references)
    cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=NEW_TOKENS)

    single = mtp_jax.generate(model, ids[:1], np.asarray(PROMPT_LENS[:1]), jax.random.key(0), cfg)
    assert np.asarray(single.tokens[0]).tolist() == references[0]
    assert int(single.lengths[0]) == NEW_TOKENS

    batch = mtp_jax.generate(model, ids, np.asarray(PROMPT_LENS), jax.random.key(0), cfg)
    assert np.asarray(batch.lengths).tolist() == [NEW_TOKENS] * len(PROMPT_LENS)
    for row, reference in enumerate(references):
        assert np.asarray(batch.tokens[row]).tolist() == reference, f"row {row}"
