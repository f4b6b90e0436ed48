"""Reusable blocks: RMSNorm, rotary embeddings, GQA attention over a fixed-shape cache, SwiGLU MLP.

Einsum letters, used the same way in every file:
  B batch, T query tokens, S cache slots, D model width, N query heads, K kv heads, G heads per kv head (N/K),
  H head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig, RopeConfig


def _init(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, fan_in: int) -> jax.Array:
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * w, computed in float32, the weight applied after casting back (as the HF reference)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> jax.Array:
    """[H/2] float32 inverse frequencies, with llama3 frequency-band scaling when configured."""
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.kind == "default":
        return inv_freq
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [B, T, H] float32 for positions [B, T] (half-split layout: the two halves repeat)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, n, H] by the tables [B, T, H] in HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    """Grouped-query attention with optional qkv/o bias and per-head q/k RMSNorm, over a fixed-shape cache."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_kv_heads = k
        self.q_proj = nnx.Param(_init(rngs, (d, n, h), dtype, d))  # DNH
        self.k_proj = nnx.Param(_init(rngs, (d, k, h), dtype, d))  # DKH
        self.v_proj = nnx.Param(_init(rngs, (d, k, h), dtype, d))  # DKH
        self.o_proj = nnx.Param(_init(rngs, (n, h, d), dtype, n * h))  # NHD
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(_init(rngs, (n, h), dtype, 1))
            self.k_bias = nnx.Param(_init(rngs, (k, h), dtype, 1))
            self.v_bias = nnx.Param(_init(rngs, (k, h), dtype, 1))
        self.o_bias = nnx.Param(_init(rngs, (d,), dtype, 1)) if cfg.o_bias else None
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.has_qkv_bias = cfg.qkv_bias
        self.scale = 1.0 / math.sqrt(h)

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        positions: jax.Array,  # [B, T] absolute positions, contiguous per row
        rope: tuple[jax.Array, jax.Array],  # cos, sin [B, T, H]
        past_k: jax.Array,  # [B, S, K, H] this layer's cache; slots >= positions[:, 0] are ignored
        past_v: jax.Array,  # [B, S, K, H]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(output [B, T, D], this block's keys [B, T, K, H], values [B, T, K, H]) — the caller stores them."""
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...])
        k = jnp.einsum("BTD,DKH->BTKH", x, self.k_proj[...])
        v = jnp.einsum("BTD,DKH->BTKH", x, self.v_proj[...])
        if self.has_qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        # Attend to the cache before this block (rollback is by length: later slots are stale) and, causally,
        # to the block itself; one softmax over both.
        b, t, n, h = q.shape
        q = q.reshape(b, t, self.num_kv_heads, n // self.num_kv_heads, h) * self.scale  # [B, T, K, G, H]
        f32 = jnp.float32
        past_scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, past_k.astype(q.dtype), preferred_element_type=f32)
        past_visible = jnp.arange(past_k.shape[1])[None, :] < positions[:, :1]  # [B, S]
        past_scores = jnp.where(past_visible[:, None, None, None, :], past_scores, -jnp.inf)
        block_scores = jnp.einsum("BTKGH,BUKH->BKGTU", q, k, preferred_element_type=f32)
        causal = jnp.tril(jnp.ones((t, t), bool))  # [T, U]
        block_scores = jnp.where(causal, block_scores, -jnp.inf)
        probs = jax.nn.softmax(jnp.concatenate([past_scores, block_scores], axis=-1), axis=-1).astype(q.dtype)
        past_probs, block_probs = probs[..., : past_k.shape[1]], probs[..., past_k.shape[1] :]
        out = jnp.einsum("BKGTS,BSKH->BTKGH", past_probs, past_v.astype(q.dtype))
        out = out + jnp.einsum("BKGTU,BUKH->BTKGH", block_probs, v)
        out = jnp.einsum("BTNH,NHD->BTD", out.reshape(b, t, n, h), self.o_proj[...])
        if self.o_bias is not None:
            out = out + self.o_bias[...]
        return out, k, v


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)), optional biases."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nnx.Param(_init(rngs, (d, f), dtype, d))  # DF
        self.up_proj = nnx.Param(_init(rngs, (d, f), dtype, d))  # DF
        self.down_proj = nnx.Param(_init(rngs, (f, d), dtype, f))  # FD
        if cfg.mlp_bias:
            self.gate_bias = nnx.Param(_init(rngs, (f,), dtype, 1))
            self.up_bias = nnx.Param(_init(rngs, (f,), dtype, 1))
            self.down_bias = nnx.Param(_init(rngs, (d,), dtype, 1))
        self.has_bias = cfg.mlp_bias

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate_proj[...])
        up = jnp.einsum("BTD,DF->BTF", x, self.up_proj[...])
        if self.has_bias:
            gate, up = gate + self.gate_bias[...], up + self.up_bias[...]
        out = jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, self.down_proj[...])
        return out + self.down_bias[...] if self.has_bias else out


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, rope, past_k, past_v):
        """x [B, T, D] -> (x, new keys [B, T, K, H], new values [B, T, K, H])."""
        with jax.named_scope("attention"):
            attn_out, k, v = self.attn(self.input_norm(x), positions, rope, past_k, past_v)
        x = x + attn_out
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.post_attention_norm(x))
        return x, k, v
