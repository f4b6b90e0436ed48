"""Routed mixture of experts (DeepSeek-V3 / GLM-4.5) with shared experts.

Routing: sigmoid scores; the correction bias shifts which experts are picked but not their weights; only experts
in the `topk_groups` best groups compete (a group scores the sum of its two best). In a large pass (a prefill) experts
run only on the rows routed to them: the (token, pick) rows are sorted by expert and each projection is one grouped
matmul (`jax.lax.ragged_dot`, group sizes = rows per expert); the outputs are put back in token order and summed
with their routing weights. A small pass (a decode step or a verify block, at most DENSE_EXPERT_ROWS rows) reads
only the experts its rows use where the execution plan has a form for it (kernels/routed_kernel.py: on a TPU a
Pallas kernel reading each used expert where it lies in the layer stack, elsewhere XLA's gather of the used
experts where that copy costs less than reading them all); otherwise it runs every expert on every row and weights
each output by the row's routing (zero for experts it did not pick): plain dots that read a stacked layer's weights
where they lie. A larger pass whose rows fit the kernel's memory (a verify block of a large batch) takes, on a TPU,
kernels/grouped_kernel.py: the grouped matmul reading each used expert once where it lies in the stack.
Batch-invariant decoding (DecodeConfig.invariant) runs every pass that way, a large one in tiles of
DENSE_EXPERT_ROWS rows: a row's sums then never depend on how many rows came with it (a prefill pays E / O times
the routed experts' flops for it). Shared experts (a plain SwiGLU) see every token.

On a mesh whose rules split the expert weights (experts over `expert`, their width over `model`), the weights stay
where they live and the tokens go to them: inside `jax.shard_map` every expert shard sees all the rows of its data
shard (decode batches are small), runs the same grouped matmuls over the rows routed to its own experts (the others
sorted last, outside every group, and zeroed), and one `psum` over the expert and model axes adds the partial
outputs [M, D]. Left to XLA's partitioner, `ragged_dot` over expert-sharded weights gathers the weights instead.

Einsum letters (with those of layers.py): M tokens (B * T flattened), E experts, O picks per token.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from mtp_jax.config.model import ModelConfig
from mtp_jax.kernels import dispatch, traced_plan
from mtp_jax.kernels.dispatch import project
from mtp_jax.models.layers import SwiGLU, init_weight
from mtp_jax.ops.routing import routing_mix
from mtp_jax.ops.rowwise import row_sum
from mtp_jax.ops.stacked_weights import EXPERT_STACKS, StackedWeight, layer_value
from mtp_jax.parallel import sharding
from mtp_jax.quant.matmul_axes import MatmulAxes
from mtp_jax.quant.quantized_array import QuantizedArray, dense

EXPERT_WEIGHTS = EXPERT_STACKS  # [E, D, F], [E, D, F], [E, F, D]
EXPERT_AXES = {  # the routed experts' logical axes, declared where MoE and SoftmaxMoE create them (`expert_param`)
    "expert_gate": ("experts", "embed", "expert_mlp"),
    "expert_up": ("experts", "embed", "expert_mlp"),
    "expert_down": ("experts", "expert_mlp", "embed"),
}
EXPERT_MATMUL = MatmulAxes((1,), batched=(0,))  # [E, in, out]: products over `in`, each expert a matrix of its own
# Passes of at most this many rows (decode steps, verify blocks) run every expert on every row: a weight element
# then costs 2 * M flops per 2 bytes read, under every accelerator's flops-to-bandwidth ratio (about 160 to 300), so
# the pass takes the time of reading the weights it needs anyway, and its matmuls are plain dots that read a
# stacked layer's weights in place (a grouped matmul's operand is first copied out of the stack).
DENSE_EXPERT_ROWS = 128


def routed_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    first: jax.Array | int = 0,
    down_dtype=None,
    invariant: bool = False,
    manual: bool = False,
) -> jax.Array:
    """Routed outputs [M, D] float32 of x [M, D] through the experts gate, up [E, D, F] and down [E, F, D], which
    hold the global expert ids first .. first + E - 1: a (token, pick) row picking another expert contributes zero.
    Each weight may be a StackedWeight (a layer of a scanned stack, kept whole for a kernel that reads it in place).

    weights, experts [M, O]: routing weights and global expert ids. `down_dtype`: the grouped matmuls' down
    projection output type (None: x's; float32 where the F of these experts is a slice and the caller adds the
    partial outputs). `invariant`: every pass through every expert (`_every_expert_in_tiles`). `manual`: on one
    device or inside the experts' shard_map (a kernel's custom call may run).
    """
    picks, local = experts.shape[1], gate.shape[0]
    ids = experts - first  # [M, O] local expert ids
    small = x.shape[0] <= DENSE_EXPERT_ROWS
    stacks, layer = _as_stacks((gate, up, down))
    routed = None if invariant else dispatch.experts_implementation(x, ids, *stacks, manual, small)
    if routed is not None:
        return routed(x, weights, ids, layer, *stacks)
    gate, up, down = (layer_value(w) for w in (gate, up, down))
    if small:
        return _every_expert(x, weights, ids, gate, up, down)
    if invariant:
        return _every_expert_in_tiles(x, weights, ids, gate, up, down)
    gate, up, down = (dense(w) for w in (gate, up, down))  # a prefill's grouped matmuls take the weights in x's dtype
    mine = (ids >= 0) & (ids < local)
    flat = jnp.where(mine, ids, local).reshape(-1)  # [M * O]; other shards' rows get id E: sorted last, no group
    order = jnp.argsort(flat)  # rows sorted by expert (stable)
    rows = jnp.take(x, order // picks, axis=0)  # [M * O, D]
    sizes = jnp.bincount(flat, length=local).astype(jnp.int32)  # [E] rows per local expert (id E not counted)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)  # [M * O, F]
    out = jax.lax.ragged_dot(hidden, down, sizes, preferred_element_type=down_dtype)  # [M * O, D]
    out = jnp.zeros_like(out).at[order].set(out).reshape(experts.shape + out.shape[-1:])  # [M, O, D]
    out = jnp.where(mine[..., None], out, 0)  # rows past the groups: ragged_dot leaves them unspecified
    return jnp.einsum("MOD,MO->MD", out.astype(jnp.float32), weights)


def _as_stacks(params: tuple) -> tuple[tuple, jax.Array]:
    """((gate, up, down) as stacks [L, E, ...], the layer index): a StackedWeight's stack and layer, else the
    weight as a stack of one."""
    if all(isinstance(w, StackedWeight) for w in params):
        return tuple(w.stack for w in params), params[0].layer
    params = tuple(layer_value(w) for w in params)
    return tuple(jax.tree.map(lambda a: a[None], w) for w in params), jnp.zeros((), jnp.int32)


def _every_expert(x, weights, ids, gate, up, down) -> jax.Array:
    """`routed_experts` for a small pass: every local expert on every row [M, D], each expert's hidden weighted by
    what the row's picks give that expert (zero where none picks it; ids [M, O] local, out of range for other
    shards), and all experts' down projections summed in one matmul over (expert, F)."""
    e, f, d = down.shape
    mix = routing_mix(weights, ids, e)  # [M, E]
    hidden = jax.nn.silu(project("MD,EDF->MEF", x, gate)) * project("MD,EDF->MEF", x, up)  # [M, E, F]
    mixed = (hidden * mix[..., None]).astype(hidden.dtype)  # [M, E, F]
    if isinstance(down, QuantizedArray):  # scales per expert and block: the products summed over E outside the dot
        return project("MEF,EFD->MD", mixed, down, jnp.float32)
    return project("MX,XD->MD", mixed.reshape(-1, e * f), down.reshape(e * f, d), jnp.float32)


def _every_expert_in_tiles(x, weights, ids, gate, up, down) -> jax.Array:
    """`_every_expert` over tiles of DENSE_EXPERT_ROWS rows of x [M, D], one after another (padding rows pick no
    expert); float32 [M, D]."""
    rows, tile = x.shape[0], DENSE_EXPERT_ROWS
    pad = -rows % tile

    def tiles(a, fill):  # [M, ...] -> [M / tile, tile, ...]
        return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill).reshape(-1, tile, *a.shape[1:])

    out = jax.lax.map(lambda t: _every_expert(*t, gate, up, down), (tiles(x, 0), tiles(weights, 0), tiles(ids, -1)))
    return out.reshape(-1, out.shape[-1])[:rows]


def _mesh_axes(part: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def _expert_parallel(rules: sharding.ShardingRules, params: tuple[jax.Array, ...], shape: tuple[int, ...]):
    """How the expert weights `params` lie under `rules`, for hidden states of `shape` [B, T, D]: (rows' spec
    [B, T, ...], the weights' stored specs, the mesh axes splitting E, every mesh axis splitting E or F); None where
    nothing splits E or F, or where a split would need more than one psum (D split, or rows and experts sharing a
    mesh axis): XLA's partitioner then keeps the values right by gathering the weights."""
    named = zip(EXPERT_WEIGHTS, params, strict=True)
    specs = tuple(rules.spec(EXPERT_AXES[name], p.shape) for name, p in named)
    expert_axes, embed, width = (_mesh_axes(part) for part in specs[0])  # gate [E, D, F]
    rows = rules.spec(("batch", None, None), shape)
    split = tuple(a for a in rules.mesh.axis_names if a in expert_axes + width)
    if all(rules.mesh.shape[a] == 1 for a in split) or embed or set(_mesh_axes(rows[0])) & set(split):
        return None
    if any(isinstance(p, QuantizedArray) for p in params):
        specs = tuple(_quantized_spec(rules, spec, p) for spec, p in zip(specs, params, strict=True))
        if None in specs:
            return None
    return rows, specs, expert_axes, split


def _quantized_spec(
    rules: sharding.ShardingRules, spec: PartitionSpec, weight
) -> PartitionSpec | QuantizedArray | None:
    """The shard_map spec of an expert weight whose values lie as `spec`: for a quantized one, its scales split as
    its values (an axis of one scale: whole on every shard); None where a shard would hold part of a scale block."""
    if not isinstance(weight, QuantizedArray):
        return spec
    parts = []
    for part, n in zip(spec, weight.scales.shape, strict=True):
        shards = math.prod(rules.mesh.shape[a] for a in _mesh_axes(part))
        if n > 1 and n % shards:
            return None
        parts.append(None if n == 1 else part)
    scales = PartitionSpec(*parts)
    mins = None if weight.mins is None else scales
    return dataclasses.replace(weight, values=spec, scales=scales, mins=mins)  # its static fields kept


def _stacked_spec(spec, weight):
    """The shard_map spec of a StackedWeight whose layer lies as `spec` (a PartitionSpec, or a QuantizedArray of
    them): its stack's leading layer axis whole, its layer index replicated; anything else: `spec`."""
    if not isinstance(weight, StackedWeight):
        return spec
    stacked = jax.tree.map(
        lambda part: PartitionSpec(None, *part), spec, is_leaf=lambda a: isinstance(a, PartitionSpec)
    )
    return StackedWeight(stacked, PartitionSpec())


def expert_param(value: jax.Array, name: str) -> nnx.Param:
    """The routed-expert weight `name` (of EXPERT_WEIGHTS) holding `value`, with its logical axes (EXPERT_AXES) and
    its products' axes (EXPERT_MATMUL)."""
    return nnx.Param(value, axes=EXPERT_AXES[name], matmul=EXPERT_MATMUL)


class MoE(nnx.Module):
    """Sigmoid-routed experts with group-limited top-k, plus `num_shared_experts` always-on experts."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        m, d = cfg.moe, cfg.hidden_size
        e, f = m.num_experts, m.expert_intermediate_size
        # [D, E] and [E]: every shard scores every expert
        self.router = nnx.Param(init_weight(rngs, (d, e), dtype, d), axes=("embed", None))  # DE
        self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), axes=(None,))  # [E] correction bias, selection only
        self.expert_gate = expert_param(init_weight(rngs, (e, d, f), dtype, d), "expert_gate")  # EDF
        self.expert_up = expert_param(init_weight(rngs, (e, d, f), dtype, d), "expert_up")  # EDF
        self.expert_down = expert_param(init_weight(rngs, (e, f, d), dtype, f), "expert_down")  # EFD
        shared_width = f * m.num_shared_experts
        self.shared = SwiGLU(cfg, dtype=dtype, rngs=rngs, width=shared_width) if shared_width else None
        self.routing = m

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [M, D] -> (weights [M, O] float32, expert ids [M, O] int32)."""
        r = self.routing
        f32 = jnp.float32
        scores = jax.nn.sigmoid(project("MD,DE->ME", x.astype(f32), self.router[...].astype(f32)))
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
            weights = weights / (row_sum(weights)[..., None] + 1e-20)
        return weights * r.routed_scaling_factor, experts.astype(jnp.int32)

    def experts(self, x: jax.Array, weights: jax.Array, experts: jax.Array, invariant: bool = False) -> jax.Array:
        """Routed outputs [B, T, D] of x [B, T, D] (routing weights, expert ids [B, T, O]): each (token, pick) row
        goes through its own expert only; where the rules split the expert weights, on the shards holding it.
        `invariant`: the batch-invariant form (`routed_experts`)."""
        # quantized weights as stored; a StackedWeight where the layer scan kept the expert stacks whole
        params = tuple(getattr(self, name).get_value() for name in EXPERT_WEIGHTS)
        if not traced_plan.current().reads_expert_stacks_in_place:
            params = tuple(layer_value(w) for w in params)
        rules = sharding.active_rules()
        layers = tuple(w.layer_shapes() if isinstance(w, StackedWeight) else w for w in params)
        plan = None if rules is None else _expert_parallel(rules, layers, x.shape)
        if plan is None:
            d, o = x.shape[-1], experts.shape[-1]
            flat = (x.reshape(-1, d), weights.reshape(-1, o), experts.reshape(-1, o))
            out = routed_experts(*flat, *params, invariant=invariant, manual=traced_plan.current().one_device)
            return out.astype(x.dtype).reshape(x.shape)
        rows, specs, expert_axes, split = plan

        def shard(x, weights, experts, gate, up, down):  # rows [b, T, ...] of one data shard; [E/ep, D, F/tp] experts
            d, o = x.shape[-1], experts.shape[-1]
            first = jax.lax.axis_index(expert_axes) * gate.shape[0] if expert_axes else 0
            flat = (x.reshape(-1, d), weights.reshape(-1, o), experts.reshape(-1, o))
            out = routed_experts(*flat, gate, up, down, first, jnp.float32, invariant, manual=True)  # [b * T, D]
            return jax.lax.psum(out, split).astype(x.dtype).reshape(x.shape)  # the partial sums added

        specs = tuple(_stacked_spec(spec, w) for spec, w in zip(specs, params, strict=True))
        # check_vma off: a Pallas kernel's output (kernels/routed_kernel.py) carries no varying-axes type; the psum
        # adds partial sums that differ on every shard either way
        run = jax.shard_map(
            shard, mesh=rules.mesh, in_specs=(rows, rows, rows, *specs), out_specs=rows, check_vma=False
        )
        return run(x, weights, experts, *params)

    def __call__(self, x: jax.Array, invariant: bool = False) -> jax.Array:  # [B, T, D] -> [B, T, D]
        """`invariant`: the batch-invariant form of the routed experts (`routed_experts`)."""
        with jax.named_scope("router"):
            weights, experts = self.route(x.reshape(-1, x.shape[-1]))  # [M, O] each
        with jax.named_scope("routed_experts"):
            picks = (*x.shape[:-1], -1)
            out = self.experts(x, weights.reshape(picks), experts.reshape(picks), invariant)
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                out = out + self.shared(x)
        return out
