"""A large pass's routed experts (a verify block past `moe.DENSE_EXPERT_ROWS` rows), on TPU: a grouped matmul over
the whole expert stacks, reading each used expert once, where it lies.

Past DENSE_EXPERT_ROWS rows, running every used expert on every row (kernels/routed_kernel.py) costs rows x used
experts of flops; a grouped matmul (`jax.lax.ragged_dot`) runs each (row, pick) through its own expert only, but its
weight operand is a layer's slice of the scanned stack, copied out of it first (DeepSeek-V3 at batch 64, k = 3: an
MTP round moved 6.2x its routed floor). This kernel is a grouped matmul in the megablox manner, with the stacks read
in place:

  - the (row, pick) pairs are sorted by local expert (other shards' picks last, in no group) and cut into tiles of
    ROW_TILE sorted pairs; a work item is a (used expert, tile) pair whose tile holds some of that expert's pairs.
    Items run expert by expert (a tile shared by two experts is visited once for each), at most
    used experts + tiles - 1 of them, in a grid of a static size whose spare items repeat the last one and compute
    nothing;
  - the grid runs over the expert width F in tiles, then the items: a used expert's weight tile is fetched once for
    all its items (the next item names the same block) from the whole stacks [L, E, D, F] / [L, E, F, D], with the
    layer index and each item's expert as scalar-prefetch arguments: nothing is sliced or copied, and the pass
    reads exactly the experts it uses (int8 / float8 weights as stored, their scales applied in VMEM);
  - the pass's rows x [M, D] and the output [M, D] (float32, in row order) stay in VMEM for the whole call: an
    item gathers its tile's rows with a one-hot product (exact), and spreads its weighted outputs back with the
    transposed one-hot, the float32 outputs split in two parts of x's dtype (exact in float32; within 2^-16 of
    each output in bfloat16, which a pick's output otherwise is rounded to whole).
Rows whose pass does not fit VMEM (a prefill) keep `ragged_dot`. Einsum letters: M rows (padded to LANES), D model
width, F expert width, R sorted (row, pick) pairs (padded to whole tiles), G work items.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mtp_jax.kernels import routed_kernel, traced_plan

KERNEL_NAME = routed_kernel.KERNEL_NAME + "_grouped"  # hlo_traffic counts its stack reads as the routed kernel's
ROW_TILE = 128  # sorted (row, pick) pairs an item takes
VMEM_BUDGET = 56 * 2**20  # the call's VMEM at most: rows, output, weight tiles and an item's temporaries
WEIGHT_TILE_BYTES = 16 * 2**20  # of it, the weight tiles (double-buffered)


class WorkItems:
    """The sorted (row, pick) pairs of a pass and the (expert, tile) items that cover them (module doc)."""

    def __init__(self, weights: jax.Array, ids: jax.Array, local: int):
        rows, picks = ids.shape
        pairs = rows * picks
        self.tiles = -(-pairs // ROW_TILE)
        self.size = min(local, pairs) + self.tiles - 1  # G: every used expert's tiles, at most
        mine = (ids >= 0) & (ids < local)
        flat = jnp.where(mine, ids, local).reshape(-1)  # [R'] local expert of each pair (local: another shard's)
        order = jnp.argsort(flat, stable=True)
        pad = self.tiles * ROW_TILE - pairs
        group = jnp.pad(flat[order], (0, pad), constant_values=local)  # [R] each sorted pair's expert
        self.group = group.astype(jnp.int32)[:, None]  # [R, 1]
        self.row = jnp.pad(order // picks, (0, pad)).astype(jnp.int32)  # [R] the row each sorted pair comes from
        weight = jnp.pad(jnp.where(mine, weights, 0.0).reshape(-1)[order], (0, pad))
        self.weight = weight.astype(jnp.float32)[:, None]  # [R, 1] its routing weight (0: not this shard's)
        sizes = jnp.bincount(flat, length=local)  # [E] pairs per local expert
        starts = jnp.cumsum(sizes) - sizes
        first, last = starts // ROW_TILE, (starts + sizes - 1) // ROW_TILE
        spans = jnp.where(sizes > 0, last - first + 1, 0)  # [E] tiles each expert's pairs touch
        ends = jnp.cumsum(spans)
        self.count = ends[-1].astype(jnp.int32)
        item = jnp.arange(self.size)
        expert = jnp.minimum(jnp.searchsorted(ends, item, side="right"), local - 1)  # [G]
        tile = first[expert] + item - (ends - spans)[expert]
        final = jnp.maximum(self.count - 1, 0)  # spare items repeat the last: no block fetched again
        self.expert = jnp.where(item < self.count, expert, expert[final]).astype(jnp.int32)
        self.tile = jnp.where(item < self.count, tile, tile[final]).astype(jnp.int32)


def _body(quantized: tuple[bool, bool, bool], *refs):
    layer_ref, expert_ref, tile_ref, count_ref, x_ref, row_ref, row_t_ref, group_ref, weight_ref, *weights = refs
    out_ref = weights.pop()
    del layer_ref, tile_ref  # read by the index maps
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when((j == 0) & (i == 0))
    def _start():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(i < count_ref[0])
    def _accumulate():
        x = x_ref[...]  # [M, D]
        f32, rows = jnp.float32, x.shape[0]
        gather = (row_ref[...] == jax.lax.broadcasted_iota(jnp.int32, (ROW_TILE, rows), 1)).astype(x.dtype)
        picked = jnp.dot(gather, x, preferred_element_type=f32).astype(x.dtype)  # [ROW_TILE, D] the tile's rows
        gate, up, down = routed_kernel.weight_tiles(quantized, weights, x.dtype)  # [D, F'], [D, F'], [F', D]
        hidden = jax.nn.silu(jnp.dot(picked, gate, preferred_element_type=f32))
        hidden = hidden * jnp.dot(picked, up, preferred_element_type=f32)  # [ROW_TILE, F']
        mine = group_ref[...] == expert_ref[i]  # [ROW_TILE, 1]: this item's expert's pairs
        hidden = hidden * jnp.where(mine, weight_ref[...], 0.0)
        out = jnp.dot(hidden.astype(x.dtype), down, preferred_element_type=f32)  # [ROW_TILE, D]
        high = out.astype(x.dtype)
        low = (out - high.astype(f32)).astype(x.dtype)
        spread = (jax.lax.broadcasted_iota(jnp.int32, (rows, ROW_TILE), 0) == row_t_ref[...]).astype(x.dtype)
        out_ref[...] += jnp.dot(spread, high, preferred_element_type=f32) + jnp.dot(
            spread, low, preferred_element_type=f32
        )


def _padded_rows(rows: int) -> int:
    return -(-rows // routed_kernel.LANES) * routed_kernel.LANES


def _vmem_bytes(rows: int, d: int, itemsize: int, tiles: int) -> int:
    """The call's VMEM: rows and output (double-buffered), the weight tiles, an item's temporaries."""
    resident = 2 * rows * d * (itemsize + 4)
    temporaries = ROW_TILE * (3 * d * 4 + 2 * rows * itemsize)
    return resident + tiles + temporaries


def kernel_fits(x, gate, up, down) -> bool:
    """Whether a pass of these rows x [M, D] over these stacks runs in the kernel: weights it reads as stored
    (`routed_kernel.supports`) whose tiles and the pass's rows and output fit VMEM_BUDGET."""
    tile = routed_kernel.kernel_tile(gate, up, down, WEIGHT_TILE_BYTES)
    if tile is None:
        return False
    d = x.shape[1]
    itemsize = jnp.dtype(x.dtype).itemsize
    return _vmem_bytes(_padded_rows(x.shape[0]), d, itemsize, WEIGHT_TILE_BYTES) <= VMEM_BUDGET


def grouped_experts_kernel(
    x: jax.Array, weights: jax.Array, ids: jax.Array, layer: jax.Array, gate, up, down, interpret: bool = False
) -> jax.Array:
    """Routed outputs [M, D] float32 of x [M, D] through the experts its rows pick (weights, local ids [M, O]; ids
    outside [0, E) are other shards' and contribute nothing), each (row, pick) through its own expert only, reading
    each used expert's weights in layer `layer` of the stacks gate, up [L, E, D, F] and down [L, E, F, D] (arrays,
    or int8 / float8 QuantizedArrays: `routed_kernel.supports`) where they lie. `interpret`: Pallas' interpreter."""
    rows, d = x.shape
    local, f = gate.shape[1], gate.shape[-1]
    tile = routed_kernel.kernel_tile(gate, up, down, WEIGHT_TILE_BYTES)
    if tile is None:
        raise ValueError("grouped_experts_kernel: these expert weights are not ones the kernel reads (supports)")
    items = WorkItems(weights, ids, local)
    padded = _padded_rows(rows)
    x_rows = jnp.pad(x, ((0, padded - rows), (0, 0)))  # [M', D]: rows no pair comes from
    locate = lambda j, i, layer, expert, tile_of, count: (layer[0], expert[i], j)
    specs = [spec for w, down_proj in ((gate, False), (up, False), (down, True))
             for spec in routed_kernel.weight_specs(w, tile, down_proj, locate)]  # fmt: skip
    whole = lambda j, i, layer, expert, tile_of, count: (0, 0)
    column = pl.BlockSpec((ROW_TILE, 1), lambda j, i, layer, expert, tile_of, count: (tile_of[i], 0))
    row = pl.BlockSpec((1, ROW_TILE), lambda j, i, layer, expert, tile_of, count: (0, tile_of[i]))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(f // tile, items.size),
        in_specs=[
            pl.BlockSpec((padded, d), whole),
            column,  # each sorted pair's row
            row,  # the same, as a row
            column,  # its expert
            column,  # its routing weight
            *specs,
        ],
        out_specs=pl.BlockSpec((padded, d), whole),
    )
    vmem = _vmem_bytes(padded, d, jnp.dtype(x.dtype).itemsize, routed_kernel.buffered_bytes(specs, (gate, up, down)))
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    stacks = [a for w in (gate, up, down) for a in routed_kernel.operands_of(w)]
    operands = (layer, items.expert, items.tile, items.count.reshape(1), x_rows, items.row[:, None],
                items.row[None, :], items.group, items.weight, *stacks)  # fmt: skip
    out = routed_kernel.call_if_used(_body, (gate, up, down), grid_spec, (padded, d), vmem, KERNEL_NAME, interpret,
                                     items.count, operands)  # fmt: skip
    return out[:rows]


def run(x, weights, ids, layer, gate, up, down) -> jax.Array:
    """`grouped_experts_kernel` (Pallas' interpreter off a TPU: a test's plan)."""
    interpret = traced_plan.current().platform != "tpu"
    return grouped_experts_kernel(x, weights, ids, layer, gate, up, down, interpret=interpret)
