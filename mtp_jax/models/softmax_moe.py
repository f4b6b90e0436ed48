"""Softmax-routed mixture of experts with a gated shared expert (Qwen3-Next, Qwen3.5 / 3.6 MoE).

Routing: softmax over every expert's logit (float32), the top `experts_per_token` picked, their probabilities
renormalised to sum 1 when `norm_topk_prob`. The experts run as in models/moe.py (rows sorted by expert, grouped
matmuls; on a mesh splitting the expert weights, on the shards that hold them); the shared expert, a SwiGLU of
width `MoeConfig.shared_width`, is scaled per token by sigmoid(x . w_gate).

Einsum letters: those of layers.py and moe.py (M tokens, E experts, O picks per token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config.model import ModelConfig
from mtp_jax.kernels.dispatch import project
from mtp_jax.models.layers import SwiGLU, init_weight
from mtp_jax.models.moe import MoE, expert_param
from mtp_jax.ops.rowwise import row_sum


class GatedSharedExpert(nnx.Module):
    """sigmoid(x . w) * SwiGLU(x): a shared expert whose contribution each token gates itself."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None, width: int):
        self.mlp = SwiGLU(cfg, dtype=dtype, rngs=rngs, width=width)
        self.gate = nnx.Param(init_weight(rngs, (cfg.hidden_size,), dtype, cfg.hidden_size), axes=("embed",))  # [D]

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        gate = jax.nn.sigmoid(project("BTD,D->BT", x, self.gate[...]))
        return gate[..., None] * self.mlp(x)


class SoftmaxMoE(MoE):
    """models/moe.py's experts and forward pass with softmax top-k routing and a gated shared expert (no
    correction bias, no expert groups)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        m, d = cfg.moe, cfg.hidden_size
        e, f = m.num_experts, m.expert_intermediate_size
        self.router = nnx.Param(init_weight(rngs, (d, e), dtype, d), axes=("embed", None))  # DE: every shard scores all
        self.expert_gate = expert_param(init_weight(rngs, (e, d, f), dtype, d), "expert_gate")  # EDF
        self.expert_up = expert_param(init_weight(rngs, (e, d, f), dtype, d), "expert_up")  # EDF
        self.expert_down = expert_param(init_weight(rngs, (e, f, d), dtype, f), "expert_down")  # EFD
        shared_width = m.shared_width
        self.shared = GatedSharedExpert(cfg, dtype=dtype, rngs=rngs, width=shared_width) if shared_width else None
        self.routing = m

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [M, D] -> (weights [M, O] float32, expert ids [M, O] int32)."""
        r = self.routing
        f32 = jnp.float32
        logits = project("MD,DE->ME", x.astype(f32), self.router[...].astype(f32))
        exp = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        probs = exp / row_sum(exp)[..., None]  # the softmax, summed in a fixed order
        weights, experts = jax.lax.top_k(probs, r.experts_per_token)
        if r.norm_topk_prob:
            weights = weights / row_sum(weights)[..., None]
        return weights * r.routed_scaling_factor, experts.astype(jnp.int32)
