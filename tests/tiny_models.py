"""Tiny models of our own for loop tests: random, and "predictable" (an MTP head that is usually right)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax
from mtp_jax.config import ModelConfig, MtpConfig


def tiny_config(layout: str = "deepseek", vocab: int = 24, eos: tuple[int, ...] = (3,)) -> ModelConfig:
    return ModelConfig(
        family="mimo" if layout == "mimo" else "llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=layout == "mimo",
        eos_token_ids=eos,
        mtp=MtpConfig(layout=layout),
    )


def predictable_model(
    layout: str = "deepseek", seed: int = 0, context_scale: float = 0.3, noise: float = 0.02, cfg=None
):
    """A near-bigram trunk (attention and MLP outputs scaled down, still context-dependent) and an MTP head wired
    to apply the same bigram map to its input token, so drafts are mostly, not always, right. `cfg`: another
    shape than `tiny_config(layout)` (same layout)."""
    model = mtp_jax.CausalLM(cfg or tiny_config(layout), rngs=nnx.Rngs(seed))
    layers = model.segments[0].layers
    layers.attn.o_proj[...] = layers.attn.o_proj[...] * context_scale
    layers.mlp.down_proj[...] = layers.mlp.down_proj[...] * context_scale
    d = model.config.hidden_size
    eye, zero = jnp.eye(d), jnp.zeros((d, d))
    select_token = jnp.concatenate([zero, eye] if layout == "mimo" else [eye, zero], axis=0)  # [2D, D]
    model.mtp.proj[...] = select_token + noise * jax.random.normal(jax.random.key(seed + 1), select_token.shape)
    block = model.mtp.block.layers
    block.attn.o_proj[...] = block.attn.o_proj[...] * noise
    block.mlp.down_proj[...] = block.mlp.down_proj[...] * noise
    return model
