"""Every quantized format multiplied as stored: an einsum of activations by a `QuantizedArray` in float32, the stored
values entering the product as they are and the scales (and 4-bit blocks' mins) applied to the partial products, so
that no dequantized copy of the weight is formed. XLA's form, on every platform; the kernels that read a format in
place (kernels/cpu/cpu_rows.py, kernels/fixed_tiles.py, kernels/routed_kernel.py) give the same products."""

from __future__ import annotations

import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from mtp_jax.quant.int8_activations import activations_rounded_to_int8
from mtp_jax.quant.quantized_array import QuantizedArray


def quantized_einsum(equation: str, x: jax.Array, weight: QuantizedArray) -> jax.Array:
    """jnp.einsum(equation, x, weight.dequantize()) in float32, the weight read as stored (`blocked_einsum`); with
    `mins`, plus the product of x's block sums by the mins (`min_products`); with `int8_activations`, x rounded first
    (`activations_rounded_to_int8`)."""
    if weight.int8_activations:
        x = activations_rounded_to_int8(equation, x, weight)
    levels = QuantizedArray(weight.levels(), weight.scales, weight.dtype)
    product = blocked_einsum(equation, x, levels)
    return product if weight.mins is None else product + min_products(equation, x, weight.mins, weight.shape)


def min_products(equation: str, x: jax.Array, mins: jax.Array, shape: Sequence[int]) -> jax.Array:
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
            mins = spread_blocks(mins, axis, d)
        elif n != d:  # x summed over each block of d / n (the whole axis: n = 1)
            at = lead + lhs.removeprefix("...").index(letter)
            x = jnp.sum(split_axis(x, at, n), axis=at + 1)
    return jnp.einsum(equation, x, mins, preferred_element_type=jnp.float32)


def blocked_einsum(equation: str, x: jax.Array, weight: QuantizedArray) -> jax.Array:
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
            scales = spread_blocks(scales, axis, d)
            scale_axes.append((letter, scales.shape[axis]))
        elif n == 1:  # one scale along the whole contracting axis
            scale_axes.append((None, 1))
        elif n == d:  # a scale per element: the axis stays in the partial products
            blocks += letter
            scale_axes.append((letter, n))
        else:  # blocks of d / n: [.., d, ..] viewed as [.., n, d / n, ..]
            block = next(free)
            x = split_axis(x, lhs.removeprefix("...").index(letter) + x.ndim - len(lhs.removeprefix("...")), n)
            values = split_axis(values, rhs.index(letter), n)
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


def spread_blocks(scales: jax.Array, axis: int, size: int) -> jax.Array:
    """scales with n values along `axis` -> `size` values, each repeated size / n times (a broadcast and a reshape,
    no gather; compiled for TPU the spread expert scales are still written out: `loop_weights` spreads them once, before
    the loop; n = 1 or n = size: as they are)."""
    n = scales.shape[axis]
    if n in (1, size):
        return scales
    wide = jnp.expand_dims(scales, axis + 1)
    wide = jnp.broadcast_to(wide, (*wide.shape[: axis + 1], size // n, *wide.shape[axis + 2 :]))
    return wide.reshape(*scales.shape[:axis], size, *scales.shape[axis + 1 :])


def split_axis(a: jax.Array, axis: int, n: int) -> jax.Array:
    """a's `axis` of d elements viewed as [n, d / n] (consecutive elements in a block)."""
    return a.reshape(*a.shape[:axis], n, a.shape[axis] // n, *a.shape[axis + 1 :])
