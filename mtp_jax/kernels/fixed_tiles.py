"""Products whose every output element is summed in one fixed order, whatever the shape of the pass: the matmuls of
batch-invariant decoding on a GPU, with weights kept int8 / fp8 read as stored.

XLA's GPU compiler picks a matmul's kernel by shape (cuBLAS or a Triton tiling, with or without a split of the
contracting axis), and those kernels add a row's products in other orders. Measured on an H100 with the default
model in bfloat16: under `DecodeConfig(invariant=True)` MTP k = 2 and 3 equalled plain decoding (passes of 24 and 32
rows) while k = 1 (16 rows) and a lone prompt (2 rows) did not
(docs/benchmarks-log.md#one-h100-bfloat16-invariance-of-the-default-model-on-a-gpu-and-the-quantized-matmul).

Here every product is one Pallas kernel with fixed tiles (`Tiles`): a program per tile of `rows` by `cols` outputs,
each walking the contracting axis in steps of `depth` and adding each step's tile product to a float32
accumulator. An output element's sum then depends only on its own row and column: the same tiles, in the same
order, with the same instructions, for 1 row or 10 000 (rows are padded to whole tiles with zeros, which add
nothing to another row). On a GPU the kernel is compiled by Triton; elsewhere it runs in Pallas' interpreter (for
tests; slow).

A weight stored quantized (`quant.QuantizedArray`) is loaded as stored, a tile at a time, and upcast to the
activations' dtype in registers (int8 and e4m3 values are exact in bfloat16): its scales multiply each step's
partial product (blocks along the contracting axis, fp8's 128) or the finished sum (one scale per output channel,
int8). No dequantized copy of the weight is made. (On an H100, at decode's row counts, these tiles read int8 and fp8
weights more slowly than XLA's own product does (measured: docs/benchmarks.md#h100), so outside the invariant mode
quantized weights keep XLA's.)

An execution plan takes it (`Products.FIXED_TILES`, config/execution_plan.py) for every product of a batch-invariant
decode on one device of PLATFORMS (a custom kernel is not split by XLA's partitioner). `TILES` was chosen on the
H100 among seven tilings, by the quantized products' time (measured: docs/benchmarks.md#h100, which links the
log's table of tilings).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mtp_jax.ops import matmul_layout
from mtp_jax.ops.rowwise import rows_as_read
from mtp_jax.ops.stacked_weights import layer_value
from mtp_jax.parallel.sharding import active_platform
from mtp_jax.quant.quantized_array import QuantizedArray


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A program's tile: `rows` x `cols` outputs, the contracting axis in steps of `depth`; Triton's warps and
    pipeline stages per program. Any choice keeps a row's sums independent of the pass; another choice gives other
    sums."""

    rows: int = 16
    cols: int = 64
    depth: int = 64
    warps: int = 4
    stages: int = 2


TILES = Tiles(rows=16, cols=64, depth=128, warps=4, stages=3)
PLATFORMS = ("gpu",)  # where batch-invariant decoding uses these kernels


def run_product(equation: str, x: jax.Array, weight, out_dtype) -> jax.Array:
    """A projection in fixed tiles (a weight stored quantized read as stored)."""
    weight = layer_value(weight)  # a quantized weight read as stored
    return einsum(equation, rows_as_read(equation, x, weight), weight).astype(out_dtype)


def einsum(equation: str, a: jax.Array, b: jax.Array | QuantizedArray) -> jax.Array:
    """jnp.einsum(equation, a, b) in float32, each output element summed in a fixed order (module docstring); a
    quantized b is read as stored (its scales need contracting blocks of whole `depth` steps, else it is dequantized
    first, as 4-bit blocks are). The equation's letters are laid out as `matmul_layout` says: b is read in place
    when stored [.., K, N] or [.., N, K] (a weight [D, V] or an embedding [V, D])."""
    lay = matmul_layout.layout(equation, a.shape, b.shape)
    scales = None
    if isinstance(b, QuantizedArray):
        kb, k = matmul_layout.contracting_blocks(lay, b), lay.gmkn[2]
        whole_steps = kb is not None and (kb == 1 or (k // kb) % TILES.depth == 0)
        whole_steps = whole_steps and b.mins is None and not b.packed  # 4-bit blocks: dequantized
        b, scales = (b.values, matmul_layout.scales(lay, b)) if whole_steps else (b.dequantize(), None)  # [G, KB, N]
    b = matmul_layout.weight(lay, b if scales is not None else b.astype(a.dtype))
    a = matmul_layout.activations(lay, a)
    product = matmul(a, b, scales, lay.transposed, TILES, interpret=active_platform() != "gpu")  # [G, M, N]
    return matmul_layout.output(lay, product)


@functools.partial(jax.jit, static_argnames=("transposed", "tiles", "interpret"))
def matmul(
    a: jax.Array,
    b: jax.Array,
    scales: jax.Array | None = None,
    transposed: bool = False,
    tiles: Tiles = TILES,
    interpret: bool = False,
) -> jax.Array:
    """a [G, M, K] @ b [G, K, N] (b [G, N, K] when `transposed`) -> float32 [G, M, N], with fixed tiles. b may be
    stored in another dtype than a (int8, float8): it is upcast a tile at a time. `scales` [G, KB, N] (float32)
    multiply the product: KB = 1, one per output column, applied to the sum; else one per column and block of
    K / KB consecutive contracting elements (a whole number of `tiles.depth` steps), applied to each step."""
    g, m, k = a.shape
    n = b.shape[1] if transposed else b.shape[2]
    padded = -(-m // tiles.rows) * tiles.rows
    a = jnp.pad(a, ((0, 0), (0, padded - m), (0, 0)))  # whole row tiles; zero rows add nothing to another row
    if scales is None:
        scales = jnp.ones((g, 1, n), jnp.float32)
    b_block = (None, tiles.cols, k) if transposed else (None, k, tiles.cols)
    out = pl.pallas_call(
        functools.partial(_tile_kernel, k_size=k, n_size=n, transposed=transposed, tiles=tiles),
        out_shape=jax.ShapeDtypeStruct((g, padded, n), jnp.float32),
        grid=(g, padded // tiles.rows, pl.cdiv(n, tiles.cols)),
        in_specs=[
            pl.BlockSpec((None, tiles.rows, k), lambda i, r, c: (i, r, 0)),
            pl.BlockSpec(b_block, (lambda i, r, c: (i, c, 0)) if transposed else (lambda i, r, c: (i, 0, c))),
            pl.BlockSpec((None, scales.shape[1], tiles.cols), lambda i, r, c: (i, 0, c)),
        ],
        out_specs=pl.BlockSpec((None, tiles.rows, tiles.cols), lambda i, r, c: (i, r, c)),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret,
    )(a, b, scales.astype(jnp.float32))
    return out[:, :m]


def _tile_kernel(a_ref, b_ref, s_ref, out_ref, *, k_size: int, n_size: int, transposed: bool, tiles: Tiles):
    """One [rows, cols] tile of the product: a_ref [rows, K], b_ref [K, cols] ([cols, K] when transposed; its last
    tile may run past N), s_ref [KB, cols], the contracting axis in steps of `depth`, in order."""
    depth = tiles.depth
    cols = pl.program_id(2) * tiles.cols + jnp.arange(tiles.cols)
    col_ok = cols < n_size  # [cols]
    precision = jax.lax.Precision.HIGHEST if a_ref.dtype == jnp.float32 else None  # float32: no TF32 rounding
    blocks = s_ref.shape[0]
    steps_per_block = pl.cdiv(k_size, depth) // blocks
    zero = jnp.zeros((), b_ref.dtype)  # a masked element of b, in b's stored dtype

    def scale(block):  # [1, cols]: the scales of one contracting block
        return plgpu.load(s_ref.at[pl.ds(block, 1), :], mask=col_ok[None, :], other=0)

    def step(i, acc):  # acc [rows, cols] float32
        span = i * depth + jnp.arange(depth)
        k_ok = span < k_size  # [depth]
        a = plgpu.load(a_ref.at[:, pl.ds(i * depth, depth)], mask=k_ok[None, :], other=0)
        if transposed:
            b = plgpu.load(b_ref.at[:, pl.ds(i * depth, depth)], mask=col_ok[:, None] & k_ok[None, :], other=zero)
            part = plgpu.dot(a, b.astype(a.dtype), trans_b=True, precision=precision)
        else:
            b = plgpu.load(b_ref.at[pl.ds(i * depth, depth), :], mask=k_ok[:, None] & col_ok[None, :], other=zero)
            part = plgpu.dot(a, b.astype(a.dtype), precision=precision)
        return acc + (part * scale(i // steps_per_block) if blocks > 1 else part)

    acc = jax.lax.fori_loop(0, pl.cdiv(k_size, depth), step, jnp.zeros((tiles.rows, tiles.cols), jnp.float32))
    if blocks == 1:
        acc = acc * scale(0)
    plgpu.store(out_ref, acc, mask=col_ok[None, :])
