"""The RMSNorm variants of the Qwen3-Next / Qwen3.5 family (the plain one is layers.RMSNorm).

- `ZeroCenteredRMSNorm`: x / rms(x) * (1 + w), the weight stored centred on 0 (every norm of the trunk, the
  MTP layer and the attention's q/k norms).
- `GatedRMSNorm`: rmsnorm(x) * w * silu(z), the output norm of the gated DeltaNet (plain weight, centred on 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.ops.rowwise import row_sum


def _normalize(x32: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, float32 in and out."""
    return x32 * jax.lax.rsqrt(row_sum(x32 * x32)[..., None] / x32.shape[-1] + eps)


class ZeroCenteredRMSNorm(nnx.Module):
    """x / rms(x) * (1 + w), all in float32 and cast back at the end (as the HF reference: the weight is applied
    before the cast, unlike layers.RMSNorm, and 1 + w is never rounded to the weight's dtype)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, axes: tuple[str | None, ...] = ("embed",)):
        self.scale = nnx.Param(jnp.zeros((dim,), dtype), axes=axes)  # [dim]; `axes`: its logical axis
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = _normalize(x.astype(jnp.float32), self.eps)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """rmsnorm(x) * w * silu(z) over the last axis: normed in float32, cast back, weighted, then gated by z in
    float32 and cast back again (the HF reference's order of roundings)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))  # [Y] per value-head dim: kept whole
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        weighted = self.scale[...] * _normalize(x.astype(jnp.float32), self.eps).astype(x.dtype)
        return (weighted * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
