"""Weights stored quantized and multiplied as stored inside the jitted step: int8 weight-only with per-output-channel
scales, and float8 e4m3 with block scales (the format DeepSeek-V3 / GLM-4.5-FP8 / Qwen FP8 checkpoints ship).

Decode reads every weight once per step, so its speed is the bytes it reads. A quantized matmul weight is a
`QuantizedArray`: `values` in the weight's own shape (int8, or float8_e4m3fn) and float32 `scales` with one axis per
weight axis, each of size 1 (one scale along the whole axis), the axis's size (a scale per element) or a divisor of
it (a scale per block of consecutive elements). It sits in the weight's `nnx.Param`. The model's projections pass
the stored value to `rowwise.project`, which multiplies by the stored values and applies the scales to the float32
partial products (`quantized_einsum`): no dequantized copy of the weight is formed, and compiled for TPU a decode
pass reads the weight at its stored size. Reading the parameter (`param[...]`) gives `values * scales` (blocks
expanded) in the model's dtype, for the few places that need the weight itself (latent attention's absorbed kv_b,
a prefill's grouped expert matmuls). Stacked layers stack both arrays; shardings follow the weight's logical axes
(declared where it is created: `sharding.param_axes`); a scale axis that its mesh axes do not divide is replicated.

- int8: symmetric, one scale per output channel (max |w| over the contracting axes / 127).
- int4: 4-bit values 0..15 with a float16 scale and min per block of 32 consecutive contracting elements, two values
  a byte (llama.cpp's Q4_1 layout: 5 bits a weight; from a Q4_1 GGUF's dequantized weights it finds the file's own
  blocks again). Read as stored by the CPU row kernel (models/cpu_rows.py); elsewhere XLA unpacks the values first
  (compiled for TPU that writes them out: use int8 or fp8 there). Embeddings and lm_heads are stored as under int8.
- fp8: blocks of 128 x 128 as the checkpoints use them: 128 consecutive inputs (the contracting axes flattened) by
  128 consecutive outputs (the output axes flattened), laid on our axes by `axis_blocks`; scale = max |w| / 448 per
  block. A layer or expert axis is never blocked across.

What stays unquantized: norms, biases, routers, the DeltaNet convolution and decay parameters, the MTP fusion's
small gates, and under fp8 the embeddings and lm_heads (the checkpoints keep them in bfloat16). Under int8 the
embeddings and lm_heads (the MTP layer's own too) are stored int8 with one scale per vocabulary entry (`HEADS`): a
small model's tied head is as large as its layers together and is read at every step (the default model: 28M of
its 135M weights), and llama.cpp's files keep it 8-bit too. An embedding lookup dequantizes just the rows it takes
(`take_rows`). The MTP layer's decoder block is quantized like the trunk's layers (its `proj` fusion included).

    model = quant.quantize_model(model, "fp8")   # in place; greedy MTP stays equal to plain on the stored weights
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import WEIGHT_FORMATS
from mtp_jax.sharding import active_platform, param_axes

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128
INT4_BLOCK = 32  # contracting elements per 4-bit block (llama.cpp's Q4_0 / Q4_1)
INT4_LEVELS = 15.0
INT8_ROW_LEVELS = 127.0  # activations rounded to int8 (`rounded_rows`): -127..127

# Contracting axes of each quantized weight, counted over its own axes (without a leading stacked-layer axis), by
# the last component of its path: the scales keep every other axis (one scale per output channel).
CONTRACTING: dict[str, tuple[int, ...]] = {
    "q_proj": (0,), "k_proj": (0,), "v_proj": (0,), "o_proj": (0, 1),  # GQA and gated attention; MLA's q and o
    "gate_proj": (0,), "up_proj": (0,), "down_proj": (0,),  # dense MLP, shared experts, the attention output gate
    "q_a_proj": (0,), "q_b_proj": (0,), "kv_a_proj": (0,), "kv_b_proj": (0,),  # latent attention
    "expert_gate": (1,), "expert_up": (1,), "expert_down": (1,),  # routed experts [E, in, out]
    "in_proj_qkv": (0,), "in_proj_z": (0,), "in_proj_b": (0,), "in_proj_a": (0,), "out_proj": (0, 1),  # DeltaNet
    "proj": (0,),  # the MTP layer's [2D, D] fusion
}  # fmt: skip
# Weights whose readers split them along an output axis, each part in a product of its own: latent attention's
# absorbed products take kv_b's key and value halves (`block_parts`), so its scales stay in blocks before the loop.
SPLIT_READS = {"kv_b_proj"}
BATCHED = {"expert_gate": (0,), "expert_up": (0,), "expert_down": (0,)}  # own axes that index matrices (experts)
# Embeddings [V, D] (a tied lm_head reads one as "...D,VD->...V") and lm_heads [D, V], quantized under int8 only:
# their contracting axis, so that each vocabulary entry has its scale.
HEADS: dict[tuple[str, ...], tuple[int, ...]] = {
    ("embed",): (1,), ("lm_head",): (0,), ("mtp", "embed"): (1,), ("mtp", "head"): (0,),
}  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """values (int8 or float8_e4m3fn, the weight's shape; or 4-bit values 0..15 `packed` two to a uint8 along the
    last axis, the even index in the low nibble; uint8 values are packed ones) times scales (float32 or float16,
    one axis per weight axis: 1, the axis's size, or a divisor of it for blocks of consecutive elements), plus
    `mins` where given (as the scales: 4-bit blocks store value * scale + min), read in `dtype`; `int8_rows`: the
    activations multiplying it are rounded to int8 per block first (`round_rows_to_int8`)."""

    values: jax.Array
    scales: jax.Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))
    mins: jax.Array | None = None
    packed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    bits_of: jnp.dtype | None = dataclasses.field(default=None, metadata=dict(static=True))  # `hold_float8_as_bits`
    int8_rows: bool = dataclasses.field(default=False, metadata=dict(static=True))  # `round_rows_to_int8`

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
        if self.packed:
            return unpack_nibbles(self.values)
        return self.values if self.bits_of is None else jax.lax.bitcast_convert_type(self.values, self.bits_of)

    def as_stored(self) -> QuantizedArray:
        """This weight with float8 values held as bits (`hold_float8_as_bits`) back in their float8 type: as files
        and checkpoints store it."""
        return self if self.bits_of is None else dataclasses.replace(self, values=self.levels(), bits_of=None)

    def dequantize(self) -> jax.Array:
        w = self.levels().astype(jnp.float32) * expand_blocks(self.scales.astype(jnp.float32), self.shape)
        if self.mins is not None:
            w = w + expand_blocks(self.mins.astype(jnp.float32), self.shape)
        return w.astype(self.dtype)

    def __getitem__(self, index):
        return self.dequantize()[index]


def pack_nibbles(levels: jax.Array) -> jax.Array:
    """uint8 values 0..15 [..., 2n] -> [..., n], two to a byte: the even index in the low nibble."""
    pairs = levels.astype(jnp.uint8).reshape(*levels.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """`pack_nibbles` undone: uint8 [..., n] -> [..., 2n]."""
    pairs = jnp.stack([packed & 15, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


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


def quantized_einsum(equation: str, x: jax.Array, weight: QuantizedArray) -> jax.Array:
    """jnp.einsum(equation, x, weight.dequantize()) in float32, the weight read as stored (`_blocked_einsum`); with
    `mins`, plus the product of x's block sums by the mins (`_min_products`); with `int8_rows`, x rounded first
    (`rounded_rows`)."""
    if weight.int8_rows:
        x = rounded_rows(equation, x, weight)
    levels = QuantizedArray(weight.levels(), weight.scales, weight.dtype)
    product = _blocked_einsum(equation, x, levels)
    return product if weight.mins is None else product + _min_products(equation, x, weight.mins, weight.shape)


def rounded_rows(equation: str, x: jax.Array, weight: QuantizedArray) -> jax.Array:
    """x (float32) rounded to int8 per block of the contracting elements that `weight`'s scales cut (llama.cpp's
    Q8_1): d = max |x| / 127 over the block, q = x / d rounded to the nearest integer (ties to even), returned as
    q * d. The row kernel (native/row_int8.h) rounds the same way and sums the products of q as integers. Its
    gradient is x's own (straight through the rounding, whose own is zero almost everywhere)."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    own = lhs.removeprefix("...")
    lead = x.ndim - len(own)
    x = x.astype(jnp.float32)
    split, inner = list(x.shape[:lead]), []
    for letter, size in zip(own, x.shape[lead:], strict=True):
        if letter in out or letter not in rhs:
            split.append(size)
            continue
        n = weight.scales.shape[rhs.index(letter)]
        split += [n, size // n]
        inner.append(len(split) - 1)
    blocks = x.reshape(split)
    d = jnp.max(jnp.abs(blocks), axis=tuple(inner), keepdims=True) / INT8_ROW_LEVELS
    inverse = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    rounded = (jnp.round(blocks * inverse) * d).reshape(x.shape)
    return jax.lax.stop_gradient(rounded) + (x - jax.lax.stop_gradient(x))  # the value rounded exactly


def round_rows_to_int8(model) -> int:
    """Mark every 4-bit weight of `model` (`--weights int4`, a GGUF's Q4_1 blocks) to multiply activations
    rounded to int8 per block (`rounded_rows`), as llama.cpp multiplies them, in place; returns how many. A
    different model from the float activations' (logits move by about the 4-bit weights' own error, see
    docs/benchmarks.md), but plain and MTP decoding of it agree as ever: each row is rounded by itself."""
    marked = 0
    for _, param in nnx.iter_graph(model):
        value = param.get_value() if isinstance(param, nnx.Param) else None
        if isinstance(value, QuantizedArray) and value.packed and not value.int8_rows:
            param.set_value(dataclasses.replace(value, int8_rows=True))
            marked += 1
    return marked


def rounds_rows(model) -> bool:
    """Whether any weight of `model` multiplies activations rounded to int8 (`round_rows_to_int8`)."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, QuantizedArray))
    return any(isinstance(leaf, QuantizedArray) and leaf.int8_rows for leaf in params)


def _min_products(equation: str, x: jax.Array, mins: jax.Array, shape: Sequence[int]) -> jax.Array:
    """jnp.einsum(equation, x, mins spread over their blocks of a weight of `shape`) in float32, from x's sums over
    each block (a product over blocks, not over the weight's elements)."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    lead = x.ndim - len(lhs.removeprefix("..."))  # axes "..." stands for
    x = x.astype(jnp.float32)
    mins = mins.astype(jnp.float32)
    for axis, letter in enumerate(rhs):
        n, d = mins.shape[axis], shape[axis]
        if letter in out:
            mins = _spread(mins, axis, d)
        elif n != d:  # x summed over each block of d / n (the whole axis: n = 1)
            at = lead + lhs.removeprefix("...").index(letter)
            x = jnp.sum(_split(x, at, n), axis=at + 1)
    return jnp.einsum(equation, x, mins, preferred_element_type=jnp.float32)


def _blocked_einsum(equation: str, x: jax.Array, weight: QuantizedArray) -> jax.Array:
    """jnp.einsum(equation, x, values * scales) in float32 (weight's values unpacked, no mins), without forming
    the dequantized weight: the stored
    values (exact in x's dtype: int8 and e4m3 fit bfloat16's mantissa) enter the matmul as they are, one partial
    product per block of a contracting axis that the scales cut into blocks, and the scales multiply the float32
    partial products, which are then added (each output element's blocks in order, whatever the number of rows). A
    scale per output channel (int8) multiplies the product once. The weight's subscripts carry no "..."; x's may
    start with it.

    Compiled for TPU this reads the weight at its stored size: the block axis becomes a batch axis of the dot over
    a free view of the weight ([K, N] as [K / b, b, N]), and the scaling and the sum fuse into the dot's output."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    values, scales = weight.values, weight.scales.astype(jnp.float32)
    free = iter(sorted(set(string.ascii_letters) - set(equation)))
    blocks, scale_axes = "", []  # letters of the partial products' block axes; scales' axes as (letter, size)
    for axis, letter in enumerate(rhs):
        n, d = scales.shape[axis], weight.shape[axis]
        if letter in out:  # an output axis: scales spread over its blocks
            scales = _spread(scales, axis, d)
            scale_axes.append((letter, scales.shape[axis]))
        elif n == 1:  # one scale along the whole contracting axis
            scale_axes.append((None, 1))
        elif n == d:  # a scale per element: the axis stays in the partial products
            blocks += letter
            scale_axes.append((letter, n))
        else:  # blocks of d / n: [.., d, ..] viewed as [.., n, d / n, ..]
            block = next(free)
            x = _split(x, lhs.removeprefix("...").index(letter) + x.ndim - len(lhs.removeprefix("...")), n)
            values = _split(values, rhs.index(letter), n)
            lhs, rhs = lhs.replace(letter, block + letter), rhs.replace(letter, block + letter)
            blocks += block
            scale_axes.append((block, n))
    partial = jnp.einsum(f"{lhs},{rhs}->{blocks}{out}", x, values.astype(x.dtype), preferred_element_type=jnp.float32)
    kept = {letter: size for letter, size in scale_axes if letter}  # a whole contracting axis's scale dropped
    scales = scales.reshape(list(kept.values()))
    order = [letter for letter in blocks + out if letter in kept]
    scales = jnp.transpose(scales, [list(kept).index(letter) for letter in order])
    rows = partial.ndim - len(blocks) - len(out.removeprefix("..."))  # axes "..." stands for
    shape = [kept[letter] for letter in blocks] + [1] * rows
    shape += [kept.get(letter, 1) for letter in out.removeprefix("...")]
    return jnp.sum(partial * scales.reshape(shape), axis=tuple(range(len(blocks))))  # fuses into the dot on TPU


def _spread(scales: jax.Array, axis: int, size: int) -> jax.Array:
    """scales with n values along `axis` -> `size` values, each repeated size / n times (a broadcast and a reshape,
    no gather; compiled for TPU the spread expert scales are still written out, about 6% of the fp8 bytes; n = 1 or
    n = size: as they are)."""
    n = scales.shape[axis]
    if n in (1, size):
        return scales
    wide = jnp.expand_dims(scales, axis + 1)
    wide = jnp.broadcast_to(wide, (*wide.shape[: axis + 1], size // n, *wide.shape[axis + 2 :]))
    return wide.reshape(*scales.shape[:axis], size, *scales.shape[axis + 1 :])


def _split(a: jax.Array, axis: int, n: int) -> jax.Array:
    """a's `axis` of d elements viewed as [n, d / n] (consecutive elements in a block)."""
    return a.reshape(*a.shape[:axis], n, a.shape[axis] // n, *a.shape[axis + 1 :])


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


def quantize_blocks(weight: jax.Array, blocks: Sequence[int], qmax: float, qdtype) -> QuantizedArray:
    """Symmetric quantization with one float32 scale (max |w| over the block / qmax) per block of `blocks` (a size
    dividing each axis; the axis's size: one scale along it)."""
    w = weight.astype(jnp.float32)
    split = [n for d, b in zip(w.shape, blocks, strict=True) for n in (d // b, b)]
    amax = jnp.max(jnp.abs(w.reshape(split)), axis=tuple(range(1, len(split), 2)))  # [d // b for each axis]
    scales = jnp.where(amax > 0, amax / qmax, 1.0)  # an all-zero block: any scale
    scaled = w / expand_blocks(scales, w.shape)
    if jnp.issubdtype(qdtype, jnp.integer):
        scaled = jnp.round(scaled)
    values = jnp.clip(scaled, -qmax, qmax).astype(qdtype)
    return QuantizedArray(values, scales, jnp.dtype(weight.dtype))


def quantize_int8(weight: jax.Array, contracting: Sequence[int]) -> QuantizedArray:
    """Symmetric int8 with one float32 scale per output channel: max |w| over the contracting axes / 127."""
    blocks = [d if axis in contracting else 1 for axis, d in enumerate(weight.shape)]
    return quantize_blocks(weight, blocks, INT8_MAX, jnp.int8)


def fp8_blocks(
    shape: Sequence[int], contracting: Sequence[int], batched: Sequence[int], block=(FP8_BLOCK, FP8_BLOCK)
) -> tuple[int, ...]:
    """Per-axis box sizes, for a weight of `shape`, of blocks (outputs, inputs) = `block` over (output axes
    flattened) x (contracting axes flattened), as a checkpoint's [out, in] weight has them; `batched` axes (layers,
    experts) are never blocked across."""
    outputs = [a for a in range(len(shape)) if a not in contracting and a not in batched]
    blocks = [1] * len(shape)
    for axes, size in ((outputs, block[0]), (list(contracting), block[1])):
        for axis, box in zip(axes, axis_blocks([shape[a] for a in axes], size), strict=True):
            blocks[axis] = box
    return tuple(blocks)


def quantize_fp8(weight: jax.Array, contracting: Sequence[int], batched: Sequence[int] = ()) -> QuantizedArray:
    """float8 e4m3 values with a float32 scale per 128 x 128 block (`fp8_blocks`): max |w| over the block / 448."""
    blocks = fp8_blocks(weight.shape, contracting, batched)
    return quantize_blocks(weight, blocks, FP8_MAX, jnp.float8_e4m3fn)


def _contracting_blocks(shape: Sequence[int], contracting: Sequence[int]) -> list[int]:
    """Per-axis box sizes of blocks of INT4_BLOCK consecutive contracting elements (`axis_blocks`), 1 elsewhere."""
    blocks = [1] * len(shape)
    for axis, box in zip(contracting, axis_blocks([shape[a] for a in contracting], INT4_BLOCK), strict=True):
        blocks[axis] = box
    return blocks


def _block_reduce(w: jax.Array, blocks: Sequence[int], reduce) -> jax.Array:
    """`reduce` over each block of `blocks` -> [d // b for each axis]."""
    split = [n for d, b in zip(w.shape, blocks, strict=True) for n in (d // b, b)]
    return reduce(w.reshape(split), axis=tuple(range(1, len(split), 2)))


def quantize_int4(weight: jax.Array, contracting: Sequence[int]) -> QuantizedArray:
    """4-bit values 0..15 with a float16 scale and min per block of INT4_BLOCK consecutive contracting elements
    (the contracting axes flattened, `axis_blocks`): scale = (max - min) / 15, w ~ value * scale + min (the layout of
    llama.cpp's Q4_1, whose blocks this finds again from their dequantized weights). Packed two to a byte along the
    last axis where its size is even."""
    w = weight.astype(jnp.float32)
    blocks = _contracting_blocks(w.shape, contracting)
    mins = _block_reduce(w, blocks, jnp.min).astype(jnp.float16)
    high = _block_reduce(w, blocks, jnp.max)
    scales = ((high - mins.astype(jnp.float32)) / INT4_LEVELS).astype(jnp.float16)
    step = scales.astype(jnp.float32)
    step = jnp.where(step > 0, step, 1.0)  # a constant block: every value 0
    shifted = (w - expand_blocks(mins.astype(jnp.float32), w.shape)) / expand_blocks(step, w.shape)
    levels = jnp.clip(jnp.round(shifted), 0, INT4_LEVELS).astype(jnp.uint8)
    packed = w.shape[-1] % 2 == 0
    values = pack_nibbles(levels) if packed else levels.astype(jnp.int8)  # uint8 values: packed, and only then
    return QuantizedArray(values, scales, jnp.dtype(weight.dtype), mins, packed)


def quantize_int8_blocks(weight: jax.Array, contracting: Sequence[int]) -> QuantizedArray:
    """int8 values with a float16 scale per block of INT4_BLOCK consecutive contracting elements: scale = max |w| /
    127 (llama.cpp's Q8_0, whose blocks this finds again from their dequantized weights)."""
    w = weight.astype(jnp.float32)
    scales = _block_reduce(jnp.abs(w), _contracting_blocks(w.shape, contracting), jnp.max) / INT8_MAX
    scales = scales.astype(jnp.float16)
    step = scales.astype(jnp.float32)
    step = jnp.where(step > 0, step, 1.0)  # an all-zero block
    values = jnp.clip(jnp.round(w / expand_blocks(step, w.shape)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedArray(values, scales, jnp.dtype(weight.dtype))


# How a GGUF's block formats are held when weights are kept as the checkpoint ships them ("auto"), where their
# blocks cannot be moved as stored (conversion/gguf_blocks.py): by the quantizer that finds the file's own blocks
# again from the weights they dequantize to (gguf_source.block_format names them). Jitted: one program a shape.
SHIPPED_BLOCKS = {
    "Q4_1": jax.jit(quantize_int4, static_argnums=1),
    "Q8_0": jax.jit(quantize_int8_blocks, static_argnums=1),
}


def matmul_axes(path: Sequence[str], axes: Sequence[str | None]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(contracting axes, batched axes) of the whole array (leading stacked-layer axes counted as batched) of the
    weight at `path` with logical `axes` (`sharding.param_axes`: its declared ones after a `layers` axis per stacked
    axis), or None when it stays unquantized."""
    path = tuple(str(p) for p in path)
    own = CONTRACTING.get(path[-1])
    if own is None or (path[0] != "segments" and path[:2] != ("mtp", "block") and path != ("mtp", "proj")):
        return None
    lead = list(axes).count("layers")
    batched = tuple(range(lead)) + tuple(lead + axis for axis in BATCHED.get(path[-1], ()))
    return tuple(lead + axis for axis in own), batched


def stored_axes(path: Sequence[str], axes: Sequence[str | None], weights: str):
    """`matmul_axes` of the weight at `path` for storage as `weights`: under int8 and int4 the embeddings and
    lm_heads too (`HEADS`; stored int8 either way)."""
    names = tuple(str(p) for p in path)
    if weights in ("int8", "int4") and names in HEADS:
        return HEADS[names], ()
    return matmul_axes(names, axes)


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
    rows = lambda a: a if a is None or a.shape[0] == 1 else jnp.take(a, ids, axis=0)
    taken = dataclasses.replace(weight, values=jnp.take(weight.values, ids, axis=0), scales=rows(weight.scales))
    return dataclasses.replace(taken, mins=rows(weight.mins)).dequantize()


def take_columns(weight: jax.Array | QuantizedArray, ids: jax.Array):
    """jnp.take(weight, ids, axis=1).T of a [D, V] weight ([Vd, D]); a quantized one stays quantized, its scales
    (and mins) taken with its columns (4-bit values packed along V are unpacked first, one a byte)."""
    if not isinstance(weight, QuantizedArray):
        return jnp.take(weight, ids, axis=1).T
    levels = weight.levels() if not weight.packed else weight.levels().astype(jnp.int8)
    take = lambda a: None if a is None else jnp.take(a, ids, axis=1).T
    return QuantizedArray(take(levels), take(weight.scales), weight.dtype, take(weight.mins))


def take_quantized_rows(weight: jax.Array | QuantizedArray, ids: jax.Array):
    """jnp.take(weight, ids, axis=0) of a [V, D] weight; a quantized one stays quantized (its rows' scales and
    mins)."""
    if not isinstance(weight, QuantizedArray):
        return jnp.take(weight, ids, axis=0)
    take = lambda a: None if a is None else jnp.take(a, ids, axis=0)
    return dataclasses.replace(weight, values=take(weight.values), scales=take(weight.scales), mins=take(weight.mins))


def quantize_weight(weight: jax.Array, weights: str, contracting, batched, path: Sequence[str] = ()) -> QuantizedArray:
    """`weight` (at `path`) stored as `weights` ("int8", "int4" or "fp8") for a matmul over `contracting` axes,
    `batched` unblocked; under int4 an embedding or lm_head (`HEADS`) is stored int8, one scale per vocabulary
    entry: it is read as a lookup too, and llama.cpp's files keep it 8-bit."""
    if weights == "int4" and tuple(str(p) for p in path) not in HEADS:
        return quantize_int4(weight, contracting)
    if weights in ("int8", "int4"):
        return quantize_int8(weight, contracting)
    return quantize_fp8(weight, contracting, batched)


def quantize_model(model, weights: str):
    """Quantize every matmul weight of `model` in place to `weights` ("int8", "fp8"; "auto": as it is; "bfloat16":
    weights stored quantized dequantized into the model's dtype) and return it; on a mesh, the values keep the
    weight's sharding and the scales lie as the weight's axes do where the mesh divides them (else replicated)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "bfloat16":  # a model stored quantized (a converted folder's kept fp8) read back in its dtype
        for _, param in nnx.iter_graph(model):
            if isinstance(param, nnx.Param) and isinstance(param.get_value(), QuantizedArray):
                param.set_value(param.get_value().dequantize())
    if weights in ("auto", "bfloat16"):
        return model
    rules = getattr(model, "sharding_rules", None)
    for path, param in list(nnx.iter_graph(model)):
        if not isinstance(param, nnx.Param) or isinstance(param.get_value(), QuantizedArray):
            continue
        names = [str(p) for p in path]
        layout = param_axes(param, "/".join(names))
        axes = stored_axes(names, layout, weights)
        if axes is None:
            continue
        quantized = quantize_weight(param.get_value(), weights, *axes, names)
        if rules is not None:  # values and scales laid out as the weight
            place = lambda leaf, layout=layout: jax.device_put(leaf, rules.sharding(layout, leaf.shape))
            quantized = jax.tree.map(place, quantized)
        param.set_value(quantized)
    return model


def hold_float8_as_bits(model):
    """Hold every float8 weight's values as their bits (uint8; `QuantizedArray.bits_of` names the float8 type) in
    place, and return `model`: how decode holds them on a CPU. XLA:CPU has no float8 arithmetic and converts a float8
    parameter to float16 whole, once, before the loop that reads it: a copy twice the size of the weights, made at
    every call. Bits read back as float8 inside the layer are converted one layer's slice at a time (same values)."""
    for _, param in nnx.iter_graph(model):
        value = param.get_value() if isinstance(param, nnx.Param) else None
        if isinstance(value, QuantizedArray) and not value.packed and value.bits_of is None:
            dtype = jnp.dtype(value.values.dtype)
            if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
                bits = jax.lax.bitcast_convert_type(value.values, jnp.uint8)
                param.set_value(dataclasses.replace(value, values=bits, bits_of=dtype))
    return model


def prepare_for_loop(model):
    """Every quantized weight of `model` as the decode loop reads it (`loop_weight`; its values behind the barrier
    too on TPU), in place, and return `model`: traced inside jit before the loop (`speculative.round_step`), once
    per call."""
    whole = active_platform() == "tpu"
    for path, param in list(nnx.iter_graph(model)):
        value = param.get_value() if isinstance(param, nnx.Param) else None
        if isinstance(value, QuantizedArray):
            names = [str(p) for p in path]
            shape = spread_scales_shape(value, names, param_axes(param, "/".join(names)))
            param.set_value(loop_weight(value, shape, whole))
    return model


def loop_weight(weight: QuantizedArray, spread_shape: Sequence[int], whole: bool = True) -> QuantizedArray:
    """`weight` as a decode loop reads it: its scales spread to `spread_shape` (`spread_output_scales`) behind an
    optimization barrier, which XLA neither sinks back into the loop nor looks through; with `whole`, its values
    behind it too. Compiled for TPU, both save bytes at every step (DeepSeek-V3's fp8 round: docs/benchmarks.md):
      - block scales spread inside each round were written out and read back at every step (XLA does not hoist
        them out of the loop): with DeepSeek-V3's experts about 5% of an fp8 step's bytes; spread once, they cost
        4 / 128 of the float8 bytes to hold and that much to read;
      - a weight the loop's products read in another layout than its parameter's (float8 weights whose width is
        not a multiple of 128, such as latent attention's [7168, 576] kv_a) was copied into it at every step; the
        barrier's output is the loop's to lay out, so XLA copies such a weight once, before the loop. That copy is
        held beside the weight; where a GPU's products would want most weights in another layout it could double
        them, so `prepare_for_loop` asks for it on TPU only (not measured on a GPU)."""
    spread = spread_output_scales(weight, spread_shape) if tuple(spread_shape) != weight.scales.shape else weight
    if whole:
        return jax.lax.optimization_barrier(spread)
    if spread is weight:
        return weight
    return dataclasses.replace(spread, scales=jax.lax.optimization_barrier(spread.scales))


def spread_scales_shape(weight: QuantizedArray, path: Sequence[str], axes: Sequence[str | None]) -> tuple[int, ...]:
    """The shape of `weight`'s scales (the weight at `path`, logical `axes`) spread over its output axes: each
    axis the matmul neither contracts nor batches, cut into blocks, takes the weight's size (one scale along the
    whole axis stays one; 4-bit packed values: as they are). Only float8 weights have blocks along an output axis."""
    kept = matmul_axes(path, axes)
    if kept is None or weight.packed or str(path[-1]) in SPLIT_READS:
        return weight.scales.shape
    fixed = set(kept[0]) | set(kept[1])
    sizes = zip(weight.scales.shape, weight.shape, strict=True)
    return tuple(n if axis in fixed or n == 1 else d for axis, (n, d) in enumerate(sizes))


def spread_output_scales(weight: QuantizedArray, shape: Sequence[int]) -> QuantizedArray:
    """`weight` with its scales spread to `shape` (`spread_scales_shape`): the same products, bit for bit, the
    scales multiplying the partial products as they lie."""
    scales = functools.reduce(lambda s, axis: _spread(s, axis, shape[axis]), range(len(shape)), weight.scales)
    return dataclasses.replace(weight, scales=scales)


def is_quantized(model) -> bool:
    """Whether any parameter of `model` is stored quantized."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, QuantizedArray))
    return any(isinstance(leaf, QuantizedArray) for leaf in params)


def weight_bytes(model) -> int:
    """Bytes of every parameter of `model` as stored (quantized weights: values and scales)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
