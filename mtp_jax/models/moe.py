"""Routed mixture of experts (DeepSeek-V3 / GLM-4.5) with shared experts.

Routing: sigmoid scores; the correction bias shifts which experts are picked but not their weights; only experts
in the `topk_groups` best groups compete (a group scores the sum of its two best). Experts run only on the rows
routed to them: the (token, pick) rows are sorted by expert and each projection is one grouped matmul
(`jax.lax.ragged_dot`, group sizes = rows per expert); the outputs are put back in token order and summed with
their routing weights. Shared experts (a plain SwiGLU) see every token.

Einsum letters (with those of layers.py): M tokens (B * T flattened), E experts, O picks per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.models.layers import SwiGLU, _init


class MoE(nnx.Module):
    """Sigmoid-routed experts with group-limited top-k, plus `num_shared_experts` always-on experts."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        m, d = cfg.moe, cfg.hidden_size
        e, f = m.num_experts, m.expert_intermediate_size
        self.router = nnx.Param(_init(rngs, (d, e), dtype, d))  # DE
        self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32))  # [E] e_score_correction_bias, selection only
        self.expert_gate = nnx.Param(_init(rngs, (e, d, f), dtype, d))  # EDF
        self.expert_up = nnx.Param(_init(rngs, (e, d, f), dtype, d))  # EDF
        self.expert_down = nnx.Param(_init(rngs, (e, f, d), dtype, f))  # EFD
        shared_width = f * m.num_shared_experts
        self.shared = SwiGLU(cfg, dtype=dtype, rngs=rngs, width=shared_width) if shared_width else None
        self.routing = m

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [M, D] -> (weights [M, O] float32, expert ids [M, O] int32)."""
        r = self.routing
        f32 = jnp.float32
        scores = jax.nn.sigmoid(jnp.einsum("MD,DE->ME", x.astype(f32), self.router[...].astype(f32)))
        choice = scores + self.router_bias[...]
        if r.num_groups > 1:
            per_group = r.num_experts // r.num_groups
            grouped = choice.reshape(-1, r.num_groups, per_group)  # [M, groups, experts per group]
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [M, groups]
            best_groups = jax.lax.top_k(group_scores, r.topk_groups)[1]  # [M, topk_groups]
            keep = jax.nn.one_hot(best_groups, r.num_groups, dtype=jnp.bool_).any(axis=1)  # [M, groups]
            choice = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)
        experts = jax.lax.top_k(choice, r.experts_per_token)[1]  # [M, O]
        weights = jnp.take_along_axis(scores, experts, axis=1)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights * r.routed_scaling_factor, experts.astype(jnp.int32)

    def experts(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """Routed outputs [M, D]: each (token, pick) row goes through its own expert only."""
        picks = experts.shape[1]
        flat = experts.reshape(-1)  # [M * O]
        order = jnp.argsort(flat)  # rows sorted by expert (stable)
        rows = jnp.take(x, order // picks, axis=0)  # [M * O, D]
        sizes = jnp.bincount(flat, length=self.routing.num_experts).astype(jnp.int32)  # [E] rows per expert
        gate = jax.lax.ragged_dot(rows, self.expert_gate[...], sizes)  # [M * O, F]
        up = jax.lax.ragged_dot(rows, self.expert_up[...], sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.expert_down[...], sizes)  # [M * O, D]
        out = jnp.zeros_like(out).at[order].set(out).reshape(experts.shape + out.shape[-1:])  # [M, O, D]
        return jnp.einsum("MOD,MO->MD", out.astype(jnp.float32), weights).astype(x.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        flat = x.reshape(-1, x.shape[-1])  # [M, D]
        with jax.named_scope("router"):
            weights, experts = self.route(flat)
        with jax.named_scope("routed_experts"):
            out = self.experts(flat, weights, experts).reshape(x.shape)
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                out = out + self.shared(x)
        return out
