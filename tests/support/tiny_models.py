"""Tiny models of our own for loop tests: random, and "predictable" (an MTP head that is usually right)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax
from mtp_jax.config.model import ModelConfig, MtpConfig
from mtp_jax.families.registry import model_config_from_hf, tiny_configs


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


def _scale_outputs(layers, factor: float) -> None:
    """Scale what a stack of layers adds to the residual stream: attention and MLP (experts included) outputs."""
    layers.attn.o_proj[...] = layers.attn.o_proj[...] * factor
    mlp = layers.mlp
    if hasattr(mlp, "expert_down"):
        mlp.expert_down[...] = mlp.expert_down[...] * factor
        mlp.shared.down_proj[...] = mlp.shared.down_proj[...] * factor
    else:
        mlp.down_proj[...] = mlp.down_proj[...] * factor


def predictable_moe_model(family: str, seed: int = 0) -> mtp_jax.CausalLM:
    """A near-bigram trunk and an MTP head wired to apply the same bigram map to its input token (the embedding
    half of the fusion projection is the identity, its layer nearly silent), so drafts are often right."""
    cfg = model_config_from_hf(tiny_configs()[family]).replace(eos_token_ids=())
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(seed))
    for segment in model.segments:
        _scale_outputs(segment.layers, 0.3)
    d = cfg.hidden_size
    select_token = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)  # [2D, D]: [e, h] -> e
    model.mtp.proj[...] = select_token + 0.02 * jax.random.normal(jax.random.key(seed), select_token.shape)
    _scale_outputs(model.mtp.block.layers, 0.02)
    return model
