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

from mtp_jax.config.model import ModelConfig, RopeConfig
from mtp_jax.kernels.dispatch import project
from mtp_jax.models.cache_attention import AttentionForm, grouped_attention
from mtp_jax.models.norms import ZeroCenteredRMSNorm
from mtp_jax.ops.rowwise import row_sum
from mtp_jax.parallel.sharding import HIDDEN, constrain
from mtp_jax.quant.matmul_axes import MatmulAxes


def init_weight(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, fan_in: int) -> jax.Array:
    """A weight of `shape` drawn from N(0, 1 / fan_in) (zeros without `rngs`: a model to be filled by a loader)."""
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * w, computed in float32, the weight applied after casting back (as the HF reference)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, axes: tuple[str | None, ...] = ("embed",)):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=axes)  # [dim]; `axes`: its logical axis
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(row_sum(x32 * x32)[..., None] / x32.shape[-1] + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def model_norm(cfg: ModelConfig, dim: int, *, dtype) -> RMSNorm | ZeroCenteredRMSNorm:
    """The model's RMSNorm over `dim`: weight w, or (1 + w) when the family centres its weights on 0."""
    if cfg.zero_centered_norms:
        return ZeroCenteredRMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)
    return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> jax.Array:
    """[H/2] float32 inverse frequencies (H: the rotary dims), with llama3 or yarn scaling when configured."""
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.kind == "default":
        return inv_freq
    if rope.kind == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim, inv_freq)
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


def _yarn_inverse_frequencies(rope: RopeConfig, dim: int, inv_freq: jax.Array) -> jax.Array:
    """Yarn: unscaled frequencies for dims that rotate more than `beta_fast` times over the original context,
    `factor`-scaled ones below `beta_slow` rotations, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)  # [H/2]: 1 = scaled
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [B, T, H] float32 for positions [B, T] (half-split layout: the two halves repeat), times `scale`
    (yarn's attention factor)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """Rotate the leading R dims of x [B, T, n, H] by the tables [B, T, R] in HF's rotate-half convention; the other
    H - R dims pass through (partial rotary). `interleaved`: the rotary pairs are adjacent dims (x0, x1), ...;
    they are gathered into two halves first, so the rotated dims come out half-split (as transformers does)."""
    dims = cos.shape[-1]
    rotary, rest = x[..., :dims], x[..., dims:]
    if interleaved:
        rotary = jnp.concatenate([rotary[..., 0::2], rotary[..., 1::2]], axis=-1)
    half = dims // 2
    rotated = jnp.concatenate([-rotary[..., half:], rotary[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    out = rotary * cos + rotated * sin
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


class Attention(nnx.Module):
    """Grouped-query attention with optional qkv/o bias and per-head q/k RMSNorm, over a fixed-shape cache.

    `gated` (models/gated_attention.py's GatedAttention) adds an output gate `gate_proj` laid out as the query,
    takes zero-centred q/k norms and no biases."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None, gated: bool = False):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        query, kv = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        by_d = MatmulAxes((0,))  # products over D
        self.q_proj = nnx.Param(init_weight(rngs, (d, n, h), dtype, d), axes=query, matmul=by_d)  # DNH
        gate = init_weight(rngs, (d, n, h), dtype, d) if gated else None
        self.gate_proj = None if gate is None else nnx.Param(gate, axes=query, matmul=by_d)  # DNH
        self.k_proj = nnx.Param(init_weight(rngs, (d, k, h), dtype, d), axes=kv, matmul=by_d)  # DKH
        self.v_proj = nnx.Param(init_weight(rngs, (d, k, h), dtype, d), axes=kv, matmul=by_d)  # DKH
        o = init_weight(rngs, (n, h, d), dtype, n * h)
        self.o_proj = nnx.Param(o, axes=("heads", "head_dim", "embed"), matmul=MatmulAxes((0, 1)))  # NHD: over N, H
        self.has_qkv_bias = cfg.qkv_bias and not gated
        if self.has_qkv_bias:
            self.q_bias = nnx.Param(init_weight(rngs, (n, h), dtype, 1), axes=("heads", "head_dim"))  # NH
            self.k_bias = nnx.Param(init_weight(rngs, (k, h), dtype, 1), axes=("kv_heads", "head_dim"))  # KH
            self.v_bias = nnx.Param(init_weight(rngs, (k, h), dtype, 1), axes=("kv_heads", "head_dim"))  # KH
        with_o_bias = cfg.o_bias and not gated
        self.o_bias = nnx.Param(init_weight(rngs, (d,), dtype, 1), axes=("embed",)) if with_o_bias else None  # D
        norm = ZeroCenteredRMSNorm if gated else RMSNorm if cfg.qk_norm else None
        self.q_norm = None if norm is None else norm(h, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",))
        self.k_norm = None if norm is None else norm(h, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",))
        self.scale = 1.0 / math.sqrt(h)

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        positions: jax.Array,  # [B, T] absolute positions, contiguous per row
        rope: tuple[jax.Array, jax.Array],  # cos, sin [B, T, H]
        past_k: jax.Array,  # [B, S, K, H] this layer's cache; slots >= positions[:, 0] are ignored
        past_v: jax.Array,  # [B, S, K, H]
        visible_from: jax.Array | None = None,  # [B]: slots before it are ignored too
        attention: AttentionForm = AttentionForm.ONE_PASS,  # the cache's form (models/cache_attention.py)
        block_mask: jax.Array | None = None,  # [B, T, T]: the block entries each query sees (None: causally)
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(output [B, T, D], this block's keys [B, T, K, H], values [B, T, K, H]) — the caller stores them."""
        q = project("BTD,DNH->BTNH", x, self.q_proj.get_value())
        k = project("BTD,DKH->BTKH", x, self.k_proj.get_value())
        v = project("BTD,DKH->BTKH", x, self.v_proj.get_value())
        if self.has_qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        # Attend to the cache before this block (rollback is by length: later slots are stale) and, causally (or
        # as a draft tree's mask says), to the block itself; one softmax over both.
        out = grouped_attention(
            q * self.scale, k, v, positions, past_k, past_v, visible_from, attention, block_mask
        )  # [B, T, N, H]
        out = project("BTNH,NHD->BTD", out, self.o_proj.get_value())
        if self.o_bias is not None:
            out = out + self.o_bias[...]
        return out, k, v


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)), optional biases; `width` F defaults to the config's intermediate size."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None, width: int | None = None):
        d, f = cfg.hidden_size, width or cfg.intermediate_size
        by_first = MatmulAxes((0,))  # products over D (gate, up) and F (down)
        self.gate_proj = nnx.Param(init_weight(rngs, (d, f), dtype, d), axes=("embed", "mlp"), matmul=by_first)  # DF
        self.up_proj = nnx.Param(init_weight(rngs, (d, f), dtype, d), axes=("embed", "mlp"), matmul=by_first)  # DF
        self.down_proj = nnx.Param(init_weight(rngs, (f, d), dtype, f), axes=("mlp", "embed"), matmul=by_first)  # FD
        if cfg.mlp_bias:
            self.gate_bias = nnx.Param(init_weight(rngs, (f,), dtype, 1), axes=("mlp",))  # F
            self.up_bias = nnx.Param(init_weight(rngs, (f,), dtype, 1), axes=("mlp",))  # F
            self.down_bias = nnx.Param(init_weight(rngs, (d,), dtype, 1), axes=("embed",))  # D
        self.has_bias = cfg.mlp_bias

    def __call__(self, x: jax.Array, invariant: bool = False) -> jax.Array:  # [B, T, D] -> [B, T, D]
        """`invariant` (batch-invariant decoding) changes nothing here: every row's sums are its own already."""
        gate = project("BTD,DF->BTF", x, self.gate_proj.get_value())
        up = project("BTD,DF->BTF", x, self.up_proj.get_value())
        if self.has_bias:
            gate, up = gate + self.gate_bias[...], up + self.up_bias[...]
        out = project("BTF,FD->BTD", jax.nn.silu(gate) * up, self.down_proj.get_value())
        return out + self.down_bias[...] if self.has_bias else out


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)); x + mlp(norm(x)).

    `attention` and `mlp` are the block classes (default: GQA and a dense SwiGLU; see models/causal_lm.py for the
    latent-attention, gated-attention and routed-expert kinds).
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None, attention=Attention, mlp=SwiGLU):
        self.input_norm = model_norm(cfg, cfg.hidden_size, dtype=dtype)
        self.attn = attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_norm = model_norm(cfg, cfg.hidden_size, dtype=dtype)
        self.mlp = mlp(cfg, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        x,
        positions,
        rope,
        *past,
        visible_from=None,
        attention: AttentionForm = AttentionForm.ONE_PASS,
        block_mask=None,
    ):
        """x [B, T, D] and this layer's cache arrays -> (x, *this block's cache entries).

        GQA: past = (keys, values) [B, S, K, H], new keys and values [B, T, K, H]. MLA: past = (latents [B, S, C],),
        new latents [B, T, C]. `visible_from` [B]: cache slots before it are not attended to (None: all are).
        `attention`: the cache's form (models/cache_attention.py); "invariant" runs the MLP batch-invariant too.
        `block_mask` [B, T, T]: the block entries each query sees (a draft tree's; None: causally).
        """
        x = constrain(x, HIDDEN)
        with jax.named_scope("attention"):
            normed = self.input_norm(x)
            attn_out, *new = self.attn(
                normed, positions, rope, *past, visible_from=visible_from, attention=attention, block_mask=block_mask
            )
        x = x + constrain(attn_out, HIDDEN)
        with jax.named_scope("mlp"):
            invariant = attention == AttentionForm.INVARIANT
            x = x + constrain(self.mlp(self.post_attention_norm(x), invariant=invariant), HIDDEN)
        return (x, *new)
