"""Gated full attention (Qwen3-Next, Qwen3.5 / 3.6 `self_attn`): grouped-query attention whose query projection
also yields a per-head output gate, with zero-centred q/k RMSNorm and (partial) rotary on the leading dims.

    q, gate = x Wq, x Wgate;  k, v = x Wk, x Wv;  q, k = rope(norm(q)), rope(norm(k))
    out = (softmax(q k^T / sqrt(H)) v * sigmoid(gate)) Wo

The checkpoints store q_proj as [N * 2H, D], each head's query rows followed by its gate rows; the converter
splits them into q_proj and gate_proj (mtp_jax/families/qwen_hybrid_layout.py: `gated_query`).

Einsum letters: those of layers.py.
"""

from __future__ import annotations

import jax
from flax import nnx

from mtp_jax.config.model import ModelConfig
from mtp_jax.kernels.dispatch import project
from mtp_jax.models.cache_attention import AttentionForm, grouped_attention
from mtp_jax.models.layers import Attention, apply_rope


class GatedAttention(Attention):
    """Qwen3-Next / Qwen3.5 full attention over a fixed-shape cache (same cache and call as layers.Attention, whose
    projections it holds, with the output gate `gate_proj`)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        super().__init__(cfg, dtype=dtype, rngs=rngs, gated=True)

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        positions: jax.Array,  # [B, T]
        rope: tuple[jax.Array, jax.Array],  # cos, sin [B, T, R] over the R rotary dims
        past_k: jax.Array,  # [B, S, K, H]
        past_v: jax.Array,  # [B, S, K, H]
        visible_from: jax.Array | None = None,  # [B]: slots before it are ignored too
        attention: AttentionForm = AttentionForm.ONE_PASS,  # the cache's form (models/cache_attention.py)
        block_mask: jax.Array | None = None,  # [B, T, T]: the block entries each query sees (None: causally)
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(output [B, T, D], this block's keys [B, T, K, H], values [B, T, K, H]) — the caller stores them."""
        with jax.named_scope("gated_attention"):
            q = self.q_norm(project("BTD,DNH->BTNH", x, self.q_proj.get_value()))
            k = self.k_norm(project("BTD,DKH->BTKH", x, self.k_proj.get_value()))
            v = project("BTD,DKH->BTKH", x, self.v_proj.get_value())
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            out = grouped_attention(
                q * self.scale, k, v, positions, past_k, past_v, visible_from, attention, block_mask
            )
            out = out * jax.nn.sigmoid(project("BTD,DNH->BTNH", x, self.gate_proj.get_value()))
            return project("BTNH,NHD->BTD", out, self.o_proj.get_value()), k, v
