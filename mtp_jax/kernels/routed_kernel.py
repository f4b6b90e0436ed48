"""A small pass's routed experts, reading only the experts its rows pick: a Pallas kernel over the whole stack.

A decode step or a verify block (at most `moe.DENSE_EXPERT_ROWS` rows) picks few experts: a Qwen3.6-35B-A3B step at
batch 1 uses 8 of 256 per layer, DeepSeek-V3's at batch 8 about 57. Running every expert on every row reads every
expert; a grouped matmul over a layer's slice of a scanned stack copies that slice first. This kernel does neither:

  - `used_experts` lists the distinct local experts the pass routes to (U slots, U = min(E, rows x picks), the
    used ones first, the rest repeating the last used one) and how many there are (none: no call at all);
  - the kernel's grid runs over those U slots and the expert width F in tiles; the weight operands are the whole
    stacks [L, E, D, F] / [L, E, F, D] with the layer index and the used experts' ids as scalar-prefetch
    arguments, so each step's block is fetched from where the expert lies in HBM, and nothing is sliced or
    copied. A repeated slot names the block already fetched (the pipeline does not fetch it again) and its
    compute is skipped: the pass reads exactly the experts it uses;
  - each used expert runs on every row of the pass (a few rows: bandwidth, not flops, is the step's cost), its
    hidden weighted by each row's routing weight for it (zero for rows that did not pick it), and its down
    projection accumulated into the output [M, D] in float32.

int8 and float8 weights are read as stored, their scales (one per output channel, or in blocks along the
contracting axis: fp8's 128 x 128 after `quant.loop_weight` spread them over the outputs) applied to each fetched
tile in VMEM. 4-bit weights, and scales in blocks along an output axis, are not taken (`supports`).

On a TPU the kernel compiles through Mosaic; elsewhere it runs in Pallas' interpreter (tests, on a CPU). A GPU, and
a CPU with a large MoE, take `gathered_experts`: XLA's gather of the used experts' weights (a copy of the routed
experts only) and batched products. Einsum letters: M rows, D model width, F expert width, U used-expert slots.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mtp_jax.kernels import traced_plan
from mtp_jax.ops.routing import routing_mix
from mtp_jax.quant.quantized_array import QuantizedArray, dense

KERNEL_NAME = "mtp_jax_routed_experts"  # in the compiled program's custom call (hlo_traffic counts its reads)
TILE_BYTES = 20 * 2**20  # VMEM for the fetched weight tiles (two buffers each) of one grid step, at most
LANES = 128  # a TPU vector register's lanes: tiles of F are a multiple of it (or the whole of F)
SUBLANES = 8


def slots_for(rows: int, picks: int, local: int) -> int:
    """U: the most distinct local experts `rows` rows of `picks` picks can use."""
    return min(local, rows * picks)


def used_experts(ids: jax.Array, local: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """(used [U] int32: the distinct local experts picked in ids [M, O], ascending, then the last of them repeated;
    count [] int32: how many are used). Ids outside [0, local) are other shards' experts."""
    mine = (ids >= 0) & (ids < local)
    hits = jnp.zeros((local + 1,), jnp.int32).at[jnp.where(mine, ids, local).reshape(-1)].add(1)[:local]  # [E]
    count = jnp.sum(hits > 0).astype(jnp.int32)
    order = jnp.argsort(hits == 0, stable=True)[:slots].astype(jnp.int32)  # used experts first, by id
    last = order[jnp.maximum(count - 1, 0)]
    return jnp.where(jnp.arange(slots) < count, order, last), count


def supports(weight) -> bool:
    """Whether the kernel reads this expert weight as stored: a float array, or int8 / float8 values whose scales
    lie in blocks along the contracting axis only (one scale per output channel or spread over the outputs)."""
    if not isinstance(weight, QuantizedArray):
        return jnp.issubdtype(weight.dtype, jnp.floating)
    if weight.packed or weight.mins is not None or weight.bits_of is not None:
        return False
    *_, k, n = weight.shape
    blocks, columns = weight.scales.shape[-2:]
    return weight.values.dtype in (jnp.int8, jnp.float8_e4m3fn) and k % blocks == 0 and columns in (1, n)


def _tile(f: int, d: int, gate, up, down, budget: int = TILE_BYTES) -> int | None:
    """The expert width's tile: the largest divisor of F, a multiple of LANES (or F itself), whose weight tiles
    (double-buffered) fit `budget` bytes and whose down-projection scale blocks keep Mosaic's (8, 128) tiling; None
    where none does."""
    itemsize = sum(_values(w).dtype.itemsize for w in (gate, up, down))
    down_blocks = down.scales.shape[-2] if isinstance(down, QuantizedArray) else 1
    for tile in sorted({t for t in range(LANES, f + 1, LANES) if f % t == 0} | {f}, reverse=True):
        rows_of_scales = down_blocks * tile // f
        aligned = tile == f or down_blocks == 1 or (tile % (f // down_blocks) == 0 and rows_of_scales % SUBLANES == 0)
        if aligned and 2 * d * tile * itemsize <= budget:
            return tile
    return None


def _values(w):
    return w.values if isinstance(w, QuantizedArray) else w


def kernel_tile(gate, up, down, budget: int = TILE_BYTES) -> int | None:
    """The F tile the kernel would run with for these operands (stacks [L, E, ...]) with `budget` bytes of VMEM for
    the weight tiles, or None where it cannot."""
    if not all(supports(w) for w in (gate, up, down)):
        return None
    *_, d, f = gate.shape
    return _tile(f, d, gate, up, down, budget)


def weight_tiles(quantized: tuple[bool, bool, bool], refs: list, dtype) -> list[jax.Array]:
    """The fetched tiles of gate, up [D, tile] and down [tile, D] in `dtype` (int8 / float8 ones times their
    scales), from their refs (values, then scales where quantized) in order."""
    tiles, rest = [], list(refs)
    for is_quantized in quantized:
        if is_quantized:
            tiles.append(_dequantized(rest.pop(0), rest.pop(0), dtype))
        else:
            tiles.append(rest.pop(0)[...].astype(dtype))
    return tiles


def _dequantized(values_ref, scales_ref, dtype) -> jax.Array:
    """A fetched tile [K, N] times its scales [KB, N or 1] (blocks of K / KB rows), in `dtype`."""
    values = values_ref[...].astype(jnp.float32)
    scales = scales_ref[...].astype(jnp.float32)
    k, n = values.shape
    blocks = scales.shape[0]
    scaled = values.reshape(blocks, k // blocks, n) * scales[:, None, :]
    return scaled.reshape(k, n).astype(dtype)


def _body(quantized: tuple[bool, bool, bool], *refs):
    layer_ref, used_ref, count_ref, x_ref, mix_ref, *weights, out_ref = refs
    del layer_ref, used_ref  # read by the index maps
    u, j = pl.program_id(0), pl.program_id(1)

    @pl.when((u == 0) & (j == 0))
    def _start():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(u < count_ref[0])
    def _accumulate():
        x = x_ref[...]
        gate, up, down = weight_tiles(quantized, weights, x.dtype)  # [D, tile], [D, tile], [tile, D]
        f32 = jnp.float32
        hidden = jax.nn.silu(jnp.dot(x, gate, preferred_element_type=f32)) * jnp.dot(x, up, preferred_element_type=f32)
        hidden = hidden * mix_ref[...]  # [M, tile] times this expert's routing weight of each row [M, 1]
        out_ref[...] += jnp.dot(hidden.astype(x.dtype), down, preferred_element_type=f32)


def weight_specs(weight, tile: int, down: bool, locate) -> list[pl.BlockSpec]:
    """Block specs of a stack [L, E, D, F] (or [L, E, F, D] when `down`) and of its scales: the F tile of one
    expert of one layer, fetched where it lies. locate(*grid indices, *scalar-prefetch refs) -> (layer, expert,
    F tile index)."""
    *_, k, n = weight.shape

    def at(place):  # place(layer, expert, j) -> the block's index
        return lambda *args: place(*locate(*args))

    if down:
        values = pl.BlockSpec((None, None, tile, n), at(lambda layer, e, j: (layer, e, j, 0)))
    else:
        values = pl.BlockSpec((None, None, k, tile), at(lambda layer, e, j: (layer, e, 0, j)))
    if not isinstance(weight, QuantizedArray):
        return [values]
    blocks, columns = weight.scales.shape[-2:]
    if down:  # blocks along F: a tile's share of them (one block: the whole of it, at every tile)
        rows = max(1, blocks * tile // k)
        index = (lambda layer, e, j: (layer, e, j, 0)) if blocks > 1 else (lambda layer, e, j: (layer, e, 0, 0))
        scales = pl.BlockSpec((None, None, rows, columns), at(index))
    else:
        width = tile if columns > 1 else 1
        index = (lambda layer, e, j: (layer, e, 0, j)) if columns > 1 else (lambda layer, e, j: (layer, e, 0, 0))
        scales = pl.BlockSpec((None, None, blocks, width), at(index))
    return [values, scales]


def buffered_bytes(specs: list[pl.BlockSpec], weights) -> int:
    """VMEM the weight tiles of these specs take, double-buffered (specs in the order of `operands_of` each of
    weights)."""
    arrays = [a for w in weights for a in operands_of(w)]
    return sum(2 * math.prod(s.block_shape[-2:]) * a.dtype.itemsize for s, a in zip(specs, arrays, strict=True))


def operands_of(weight) -> list[jax.Array]:
    return [weight.values, weight.scales] if isinstance(weight, QuantizedArray) else [weight]


def routed_experts_kernel(
    x: jax.Array, weights: jax.Array, ids: jax.Array, layer: jax.Array, gate, up, down, interpret: bool = False
) -> jax.Array:
    """Routed outputs [M, D] float32 of x [M, D] through the experts its rows pick (weights, local ids [M, O]; ids
    outside [0, E) are other shards' and contribute nothing), reading each used expert's weights in layer `layer`
    of the stacks gate, up [L, E, D, F] and down [L, E, F, D] (arrays, or int8 / float8 QuantizedArrays:
    `supports`) where they lie. `interpret`: Pallas' interpreter (a CPU)."""
    rows, d = x.shape
    local, f = gate.shape[1], gate.shape[-1]
    slots = slots_for(rows, ids.shape[1], local)
    tile = kernel_tile(gate, up, down)
    if tile is None:
        raise ValueError("routed_experts_kernel: these expert weights are not ones the kernel reads (supports)")
    used, count = used_experts(ids, local, slots)
    mix = jnp.take(routing_mix(weights, ids, local), used, axis=1).T[..., None]  # [U, M, 1]
    locate = lambda u, j, layer, used, count: (layer[0], used[u], j)
    specs = [*weight_specs(gate, tile, False, locate), *weight_specs(up, tile, False, locate),
             *weight_specs(down, tile, True, locate)]  # fmt: skip
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(slots, f // tile),
        in_specs=[
            pl.BlockSpec((rows, d), lambda u, j, layer, used, count: (0, 0)),
            pl.BlockSpec((None, rows, 1), lambda u, j, layer, used, count: (u, 0, 0)),
            *specs,
        ],
        out_specs=pl.BlockSpec((rows, d), lambda u, j, layer, used, count: (0, 0)),
    )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    operands = (layer, used, count.reshape(1), x, mix, *operands_of(gate), *operands_of(up), *operands_of(down))
    vmem = buffered_bytes(specs, (gate, up, down))
    return call_if_used(_body, (gate, up, down), grid_spec, (rows, d), vmem, KERNEL_NAME, interpret, count, operands)


def call_if_used(body, weights, grid_spec, out_shape, vmem: int, name: str, interpret: bool, count, operands):
    """The float32 output `out_shape` of a routed-experts Pallas call of `body(quantized, *refs)` over `operands`
    (VMEM limit `vmem` bytes plus 16 MiB), or zeros where `count` (experts used here) is 0: a device none of whose
    experts the pass uses skips the call (its pipeline would fetch a first block anyway)."""
    quantized = tuple(isinstance(w, QuantizedArray) for w in weights)
    call = pl.pallas_call(
        functools.partial(body, quantized),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=vmem + 16 * 2**20
        ),
        interpret=interpret,
        name=name,
    )
    return jax.lax.cond(count > 0, lambda: call(*operands), lambda: jnp.zeros(out_shape, jnp.float32))


def gathered_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, layer: jax.Array, gate, up, down) -> jax.Array:
    """`routed_experts_kernel`'s outputs by XLA: the used experts' weights gathered out of layer `layer` of the
    stacks (a copy of the routed experts only), then batched products over the U slots; unused slots weigh zero."""
    rows = x.shape[0]
    local = gate.shape[1]
    slots = slots_for(rows, ids.shape[1], local)
    used, count = used_experts(ids, local, slots)
    mix = jnp.take(routing_mix(weights, ids, local), used, axis=1)  # [M, U]
    mix = jnp.where(jnp.arange(slots) < count, mix, 0.0)
    take = lambda w: jax.tree.map(lambda a: a[layer, used], w)  # one gather of U experts out of [L, E, ...]
    g, u, dn = (dense(take(w)).astype(x.dtype) for w in (gate, up, down))  # [U, D, F], [U, D, F], [U, F, D]
    f32 = jnp.float32
    hidden = jax.nn.silu(jnp.einsum("MD,UDF->MUF", x, g, preferred_element_type=f32))
    hidden = hidden * jnp.einsum("MD,UDF->MUF", x, u, preferred_element_type=f32)  # [M, U, F]
    mixed = (hidden * mix[..., None]).astype(x.dtype)
    return jnp.einsum("MUF,UFD->MD", mixed, dn, preferred_element_type=f32)


GATHER_COPY_FACTOR = 3  # the gathered form reads the used experts, writes their copy and reads it again


def pallas_run(x, weights, ids, layer, gate, up, down) -> jax.Array:
    """`routed_experts_kernel` (Pallas' interpreter off a TPU: a test's plan)."""
    interpret = traced_plan.current().platform != "tpu"
    return routed_experts_kernel(x, weights, ids, layer, gate, up, down, interpret=interpret)


def gather_pays(x, ids, gate) -> bool:
    """Whether copying a small pass's used experts costs less than reading every expert: U slots x
    GATHER_COPY_FACTOR < E."""
    local = gate.shape[1]
    return GATHER_COPY_FACTOR * slots_for(x.shape[0], ids.shape[1], local) < local
