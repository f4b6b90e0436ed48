"""A weight stored quantized (`QuantizedArray`) and what every format shares: its blocks of scales, reading it
back, taking rows and columns of it.

Decode reads every weight once per step, so its speed is the bytes it reads. A quantized matmul weight is a
`QuantizedArray`: `values` in the weight's own shape (int8, float8_e4m3fn, or 4-bit values packed two to a byte)
and `scales` with one axis per weight axis, each of size 1 (one scale along the whole axis), the axis's size (a scale
per element) or a divisor of it (a scale per block of consecutive elements), plus `mins` for 4-bit blocks. It sits in
the weight's `nnx.Param`. The model's projections pass the stored value to `dispatch.project`, which multiplies by
the stored values (`blocked_product.quantized_einsum`, or a kernel that reads the format in place): no dequantized
copy of the weight is formed. Reading the parameter (`param[...]`) gives `values * scales` (blocks expanded) in the
model's dtype, for the few places that need the weight itself (latent attention's absorbed kv_b, a prefill's grouped
expert matmuls). Stacked layers stack both arrays; shardings follow the weight's logical axes (declared where it is
created: `sharding.param_axes`); a scale axis that its mesh axes do not divide is replicated. An embedding lookup
dequantizes just the rows it takes (`take_rows`). Each format's module describes itself by a `WeightFormat`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

TILE_BYTES = 16  # bytes of each weight row a tile of the CPU row kernel's tile order (native/row_tiles.h)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """values (int8 or float8_e4m3fn, the weight's shape; or 4-bit values 0..15 `packed` two to a uint8 along the
    last axis, the even index in the low nibble; uint8 values are packed ones) times scales (float32 or float16,
    one axis per weight axis: 1, the axis's size, or a divisor of it for blocks of consecutive elements), plus
    `mins` where given (as the scales: 4-bit blocks store value * scale + min), read in `dtype`; `int8_activations`: the
    activations multiplying it are rounded to int8 per block first (`mark_int8_activations`); `tile_axes` (where its
    matrix lies): values, scales and mins hold the CPU row kernel's tile order (`quant.row_tiles`),
    which only that kernel reads; everything else reads the weight `in_rows`."""

    values: jax.Array
    scales: jax.Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))
    mins: jax.Array | None = None
    packed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    bits_of: jnp.dtype | None = dataclasses.field(default=None, metadata=dict(static=True))  # `hold_float8_as_bits`
    int8_activations: bool = dataclasses.field(default=False, metadata=dict(static=True))  # `mark_int8_activations`
    tile_axes: TileAxes | None = dataclasses.field(default=None, metadata=dict(static=True))  # `in_rows`

    @property
    def shape(self) -> tuple[int, ...]:
        if self.packed:
            return (*self.values.shape[:-1], 2 * self.values.shape[-1])
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def levels(self) -> jax.Array:
        """The stored values in the weight's shape (4-bit ones unpacked, as uint8; float8 bits read as float8)."""
        if self.tile_axes is not None:
            return self.in_rows().levels()
        if self.packed:
            return unpack_nibbles(self.values)
        return self.values if self.bits_of is None else jax.lax.bitcast_convert_type(self.values, self.bits_of)

    def as_stored(self) -> QuantizedArray:
        """This weight in row order, with float8 values held as bits (`hold_float8_as_bits`) back in their float8
        type: as files and checkpoints store it."""
        rows = self.in_rows()
        return rows if rows.bits_of is None else dataclasses.replace(rows, values=rows.levels(), bits_of=None)

    def in_rows(self) -> QuantizedArray:
        """This weight with its values, scales and mins in row order (from the row kernel's tile order; a weight in
        row order as it is)."""
        if self.tile_axes is None:
            return self
        order = lambda a, per: None if a is None else scale_tiles(a, self.tile_axes, per, inverse=True)
        per = 2 if self.packed else 1
        values = value_tiles(self.values, self.tile_axes, inverse=True)
        return dataclasses.replace(self, values=values, scales=order(self.scales, per), mins=order(self.mins, per),
                                   tile_axes=None)  # fmt: skip

    def dequantize(self) -> jax.Array:
        if self.tile_axes is not None:
            return self.in_rows().dequantize()
        w = self.levels().astype(jnp.float32) * expand_blocks(self.scales.astype(jnp.float32), self.shape)
        if self.mins is not None:
            w = w + expand_blocks(self.mins.astype(jnp.float32), self.shape)
        return w.astype(self.dtype)

    def __getitem__(self, index):
        return self.dequantize()[index]


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """A `--weights` format as its module declares it: its `name`; `quantize(weight, contracting, batched)`, the
    weight stored for products over its `contracting` axes, no block crossing a `batched` one; `vocabulary`, the
    format that stores an embedding or lm_head (`MatmulAxes.vocabulary`) under this one (None: they stay as they
    are). `formats.STORED_FORMATS` lists them."""

    name: str
    quantize: Callable[[jax.Array, Sequence[int], Sequence[int]], QuantizedArray]
    vocabulary: str | None


def pack_nibbles(levels: jax.Array) -> jax.Array:
    """uint8 values 0..15 [..., 2n] -> [..., n], two to a byte: the even index in the low nibble."""
    pairs = levels.astype(jnp.uint8).reshape(*levels.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """`pack_nibbles` undone: uint8 [..., n] -> [..., 2n]."""
    pairs = jnp.stack([packed & 15, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@dataclasses.dataclass(frozen=True)
class TileAxes:
    """Where a weight in the CPU row kernel's tile order keeps its matrix: its last `contracting` + `columns` axes,
    the contracting ones first ([.., K axes, N axes]), or with `columns_first` after the columns ([.., N axes, K
    axes]: an embedding read as a tied lm_head). The tiles are those of the [K, N] matrix either way."""

    contracting: int
    columns: int
    columns_first: bool = False

    def matrix(self, shape: Sequence[int]) -> tuple[tuple[int, ...], int, int]:
        """(leading axes, K, N) of an array of `shape` laid out so (values: N counts bytes; scales: KB for K)."""
        lead = tuple(shape[: len(shape) - self.contracting - self.columns])
        inner = tuple(shape[len(lead) :])
        if self.columns_first:
            return lead, math.prod(inner[self.columns :]), math.prod(inner[: self.columns])
        return lead, math.prod(inner[: self.contracting]), math.prod(inner[self.contracting :])


def _as_matrix(a: jax.Array, axes: TileAxes) -> jax.Array:
    """a -> [.., K, N] (a transposed view for `columns_first`)."""
    lead, k, n = axes.matrix(a.shape)
    return jnp.swapaxes(a.reshape(*lead, n, k), -1, -2) if axes.columns_first else a.reshape(*lead, k, n)


def _from_matrix(m: jax.Array, axes: TileAxes, shape: Sequence[int]) -> jax.Array:
    """`_as_matrix` undone: [.., K, N] -> `shape`."""
    return (jnp.swapaxes(m, -1, -2) if axes.columns_first else m).reshape(shape)


def value_tiles(values: jax.Array, axes: TileAxes, inverse: bool = False) -> jax.Array:
    """A weight's bytes (4-bit values packed along N) in the CPU row kernel's tile order (native/row_tiles.h), the same
    shape: of its [K, N] matrix (`axes`), tiles of TILE_BYTES bytes of every row, tile after tile, each four rows
    after four, byte i of row j of four at 4 i + j. `inverse`: back to its own order."""
    lead, k, row = axes.matrix(values.shape)
    tiles, n = row // TILE_BYTES, len(lead)
    if inverse:  # [.., tiles, K / 4, TILE_BYTES, 4] -> [.., K / 4, 4, tiles, TILE_BYTES]
        moved = jnp.transpose(values.reshape(*lead, tiles, k // 4, TILE_BYTES, 4), (*range(n), n + 1, n + 3, n, n + 2))
        return _from_matrix(moved.reshape(*lead, k, row), axes, values.shape)
    split = _as_matrix(values, axes).reshape(*lead, k // 4, 4, tiles, TILE_BYTES)
    return jnp.transpose(split, (*range(n), n + 2, n, n + 3, n + 1)).reshape(values.shape)


def scale_tiles(scales: jax.Array, axes: TileAxes, per_byte: int, inverse: bool = False) -> jax.Array:
    """A weight's scales or mins (a scale per column and block: [KB, N] as `axes` lays them out) in the tile order of
    its values (`value_tiles`, `per_byte` columns a byte), the same shape: tile after tile, block after block, a
    block's TILE_BYTES values of the even columns then the odd ones' (4-bit), or its columns' (8-bit). `inverse`:
    back."""
    lead, kb, n = axes.matrix(scales.shape)
    tiles, m = n // (TILE_BYTES * per_byte), len(lead)
    swap = (*range(m), m + 1, m, m + 3, m + 2)
    if inverse:  # [.., tiles, KB, per_byte, TILE_BYTES] -> [.., KB, tiles, TILE_BYTES, per_byte]
        moved = jnp.transpose(scales.reshape(*lead, tiles, kb, per_byte, TILE_BYTES), swap)
        return _from_matrix(moved.reshape(*lead, kb, n), axes, scales.shape)
    split = _as_matrix(scales, axes).reshape(*lead, kb, tiles, TILE_BYTES, per_byte)
    return jnp.transpose(split, swap).reshape(scales.shape)


def dense(weight: jax.Array | QuantizedArray) -> jax.Array:
    """A weight in its compute dtype: a quantized one dequantized, any other as it is."""
    return weight.dequantize() if isinstance(weight, QuantizedArray) else weight


def expand_blocks(scales: jax.Array, shape: Sequence[int]) -> jax.Array:
    """scales [..., n, ...] -> broadcastable to `shape`: an axis of n scales over d = n * b elements repeats each b
    times (axes of size 1 broadcast as they are)."""
    for axis, (n, d) in enumerate(zip(scales.shape, shape, strict=True)):
        if n not in (1, d):
            scales = jnp.repeat(scales, d // n, axis=axis, total_repeat_length=d)
    return scales


def axis_blocks(dims: Sequence[int], block: int) -> tuple[int, ...]:
    """Block sizes along consecutive axes `dims` whose flattened index is cut into blocks of `block`: from the last
    axis outwards, an axis the remaining block covers whole is blocked whole and the rest passes outwards; the first
    axis it does not cover gets gcd(its size, remaining) and every axis before it 1. Each resulting box lies in one
    flattened block."""
    sizes = [1] * len(dims)
    remaining = block
    for axis in reversed(range(len(dims))):
        sizes[axis] = math.gcd(dims[axis], remaining)
        if sizes[axis] < dims[axis]:
            break
        remaining //= dims[axis]
    return tuple(sizes)


def contracting_blocks(shape: Sequence[int], contracting: Sequence[int], block: int) -> list[int]:
    """Per-axis box sizes of blocks of `block` consecutive contracting elements (`axis_blocks`), 1 elsewhere."""
    blocks = [1] * len(shape)
    for axis, box in zip(contracting, axis_blocks([shape[a] for a in contracting], block), strict=True):
        blocks[axis] = box
    return blocks


def block_reduce(w: jax.Array, blocks: Sequence[int], reduce) -> jax.Array:
    """`reduce` over each block of `blocks` -> [d // b for each axis]."""
    split = [n for d, b in zip(w.shape, blocks, strict=True) for n in (d // b, b)]
    return reduce(w.reshape(split), axis=tuple(range(1, len(split), 2)))


def block_parts(weight: QuantizedArray, axis: int, sizes: Sequence[int]) -> list[QuantizedArray] | None:
    """`weight` cut along `axis` into consecutive parts of `sizes`, each kept as stored, where each part lies in one
    block of the scales along that axis (its own scale there: one value); None where a part would not (for
    example one scale per element of the axis, as int8's output channels)."""
    n, d = weight.scales.shape[axis], weight.shape[axis]
    if weight.packed or sum(sizes) != d or (n > 1 and n == d):
        return None
    block, starts = d // n, [sum(sizes[:i]) for i in range(len(sizes))]
    if any(start // block != (start + size - 1) // block for start, size in zip(starts, sizes, strict=True)):
        return None

    def part(start: int, size: int) -> QuantizedArray:
        first = start // block
        scale = lambda a: a if a is None or n == 1 else jax.lax.slice_in_dim(a, first, first + 1, axis=axis)
        values = jax.lax.slice_in_dim(weight.values, start, start + size, axis=axis)
        return dataclasses.replace(weight, values=values, scales=scale(weight.scales), mins=scale(weight.mins))

    return [part(start, size) for start, size in zip(starts, sizes, strict=True)]


def take_rows(weight: jax.Array | QuantizedArray, ids: jax.Array) -> jax.Array:
    """jnp.take(weight, ids, axis=0) in the weight's dtype; a quantized one (its scales one per row or one along
    axis 0) dequantizes only the rows taken."""
    if not isinstance(weight, QuantizedArray):
        return jnp.take(weight, ids, axis=0)
    if weight.tile_axes is not None:
        return take_quantized_rows(weight, ids).dequantize()
    rows = lambda a: a if a is None or a.shape[0] == 1 else jnp.take(a, ids, axis=0)
    taken = dataclasses.replace(weight, values=jnp.take(weight.values, ids, axis=0), scales=rows(weight.scales))
    return dataclasses.replace(taken, mins=rows(weight.mins)).dequantize()


def take_columns(weight: jax.Array | QuantizedArray, ids: jax.Array):
    """jnp.take(weight, ids, axis=1).T of a [D, V] weight ([Vd, D]); a quantized one stays quantized, its scales
    (and mins) taken with its columns (4-bit values packed along V are unpacked first, one a byte)."""
    if not isinstance(weight, QuantizedArray):
        return jnp.take(weight, ids, axis=1).T
    weight = weight.in_rows()  # (a weight in the row kernel's tile order: its scales too)
    levels = weight.levels() if not weight.packed else weight.levels().astype(jnp.int8)
    take = lambda a: None if a is None else jnp.take(a, ids, axis=1).T
    return QuantizedArray(take(levels), take(weight.scales), weight.dtype, take(weight.mins))


def take_quantized_rows(weight: jax.Array | QuantizedArray, ids: jax.Array):
    """jnp.take(weight, ids, axis=0) of a [V, D] weight; a quantized one stays quantized (its rows' scales and
    mins)."""
    if not isinstance(weight, QuantizedArray):
        return jnp.take(weight, ids, axis=0)
    if weight.tile_axes is not None:
        return _rows_of_tiles(weight, ids)
    take = lambda a: None if a is None else jnp.take(a, ids, axis=0)
    return dataclasses.replace(weight, values=take(weight.values), scales=take(weight.scales), mins=take(weight.mins))


def _rows_of_tiles(weight: QuantizedArray, ids: jax.Array) -> QuantizedArray:
    """Rows `ids` of a weight in tile order, in row order [*ids.shape, D]: gathered from the tiles of an 8-bit [V, D]
    weight (`columns_first`: row v is column v of the tiles' [D, V] matrix, lane v % TILE_BYTES of tile
    v // TILE_BYTES); any other taken from the weight in rows."""
    axes = weight.tile_axes
    if not axes.columns_first or weight.ndim != 2 or weight.packed or weight.mins is not None:
        return take_quantized_rows(weight.in_rows(), ids)
    (v, d), kb = weight.shape, weight.scales.shape[1]
    flat = ids.reshape(-1)
    tile, lane = flat // TILE_BYTES, flat % TILE_BYTES
    values = weight.values.reshape(v // TILE_BYTES, d // 4, TILE_BYTES, 4)[tile, :, lane, :]  # [n, D / 4, 4]
    scales = weight.scales.reshape(v // TILE_BYTES, kb, TILE_BYTES)[tile, :, lane]  # [n, KB]
    return dataclasses.replace(
        weight, values=values.reshape(*ids.shape, d), scales=scales.reshape(*ids.shape, kb), tile_axes=None
    )


def is_quantized(model) -> bool:
    """Whether any parameter of `model` is stored quantized."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, QuantizedArray))
    return any(isinstance(leaf, QuantizedArray) for leaf in params)


def weight_bytes(model) -> int:
    """Bytes of every parameter of `model` as stored (quantized weights: values and scales)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
