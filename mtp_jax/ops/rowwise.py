"""XLA's forms of the projections, and sums whose every row comes out the same whatever else shares the pass.

A decode step multiplies B * T rows of activations by each weight: 1 row for a plain step at batch 1, B * (k + 1)
for a verify block, thousands for a prefill. Backends pick a matmul algorithm by shape, and a row's float32 sums
then depend on how many rows came with it. Measured on XLA:CPU: a one-row product runs a matrix-vector kernel whose
sums differ from those of every product of 2 or more rows, and a bfloat16 product rounded to bfloat16 inside the dot
differs again between 32 and 40 rows; with bfloat16 operands and float32 results, every product of 2 to 4096 rows
gave each row bit for bit the same sums, wherever the row sat, and ran faster there than a bfloat16-out dot (measured:
docs/benchmarks-log.md#bfloat16-invariance-mtp-equal-to-plain-and-the-same-tokens-at-any-batch-size-cpu).

So every projection here takes float32 results (`preferred_element_type`) and rounds once to the activations'
dtype. A projection goes where the execution plan says (kernels/dispatch.py's `project`): on a CPU the row
kernel (kernels/cpu/cpu_rows.py: a decode step's few rows where it won against XLA's form here; every pass under
batch-invariant decoding), one fixed order of sums per output element for 1 row or many, and the weight read as
stored; XLA's form (`xla_project`) elsewhere. Where no such kernel is built (no C++ compiler), batch-invariant decoding
never makes a one-row pass: it decodes a lone prompt beside a copy of itself (`speculative.generate`,
`lone_rows_exact`).

Sums along a row (a norm's mean square, a softmax's total) are reductions, and XLA picks a reduction's order by
shape too: on XLA:CPU the float32 mean square of 576 values came out differently for 1, 2, 4 and 8 rows in most of
200 random trials. `row_sum` adds halves elementwise instead, a fixed tree whatever the number of rows.

On a GPU, XLA's own matmul kernels differ by shape in ways a float32 result does not undo; while a batch-invariant
decode is traced under a plan of `Products.FIXED_TILES`, every product runs through fixed tiles instead
(kernels/fixed_tiles.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.ops import matmul_layout
from mtp_jax.ops.stacked_weights import layer_value
from mtp_jax.quant.blocked_product import quantized_einsum
from mtp_jax.quant.int8_activations import activations_rounded_to_int8
from mtp_jax.quant.quantized_array import QuantizedArray

DEQUANTIZED_ROWS = 64  # a pass of more rows multiplies by a quantized weight dequantized first


def xla_project(equation: str, x: jax.Array, weight, out_dtype, invariant: bool) -> jax.Array:
    """A projection (kernels/dispatch.py's `project`) in XLA's own ops (a StackedWeight taken out of its stack); a
    quantized weight in the matmul as stored, or dequantized first in a pass of many rows outside batch-invariant
    decoding (`dequantized_first`)."""
    weight = layer_value(weight)
    if isinstance(weight, QuantizedArray):
        weight = weight.in_rows()  # a weight in the CPU row kernel's tile order, permuted back
    if isinstance(weight, QuantizedArray) and not dequantized_first(equation, x, weight, invariant):
        return quantized_einsum(equation, x, weight).astype(out_dtype)  # the stored values in the matmul
    if isinstance(weight, QuantizedArray):
        x, weight = rows_as_read(equation, x, weight), weight.dequantize()
    if batched(equation) and out_dtype == x.dtype:
        return jnp.einsum(equation, x, weight)
    return jnp.einsum(equation, x, weight, preferred_element_type=jnp.float32).astype(out_dtype)


def rows_as_read(equation: str, x: jax.Array, weight) -> jax.Array:
    """x as a product by `weight` reads it: rounded to int8 per block where the weight says so
    (`quant.activations_rounded_to_int8`; `quantized_einsum` and the CPU kernel round by themselves), else as it is."""
    return (
        activations_rounded_to_int8(equation, x, weight)
        if isinstance(weight, QuantizedArray) and weight.int8_activations
        else x
    )


def dequantized_first(equation: str, x: jax.Array, weight: QuantizedArray, invariant: bool) -> bool:
    """Whether a product by a quantized weight dequantizes the weight first (in the model's dtype, one layer's
    weight at a time) and multiplies by it: passes of more than DEQUANTIZED_ROWS rows (prefills), where the product
    is compute-bound and one partial product per block of 32 contracting elements ran at a fraction of a GEMM's
    speed (measured:
    docs/benchmarks-log.md#layers-read-in-place-from-their-stacks-prefills-through-dequantized-weights-cpu).
    Never under batch-invariant decoding (`invariant`): a prompt's rows would take another path alone than in a
    batch. Nor for a batch of matrices (routed experts, "EMF,EFD->EMD"): a layer's every expert dequantized at once
    could be gigabytes."""
    if invariant:
        return False
    g, m, _, _ = matmul_layout.layout(equation, x.shape, weight.shape).gmkn
    return g == 1 and m > DEQUANTIZED_ROWS


def batched(equation: str) -> bool:
    """Whether the equation is a batch of matmuls (an axis of x and the weight that the output keeps)."""
    inputs, output = equation.split("->")
    lhs, rhs = inputs.split(",")
    return any(letter in rhs and letter in output for letter in lhs.removeprefix("..."))


def row_sum(x: jax.Array) -> jax.Array:
    """[..., W] -> [...]: the sum along the last axis as a fixed binary tree of elementwise adds (the axis padded
    with zeros to a power of two, then its halves added until one value is left), the same sums in the same order
    for every row whatever the other axes hold."""
    width = x.shape[-1]
    size = 1 << max(width - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - width)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
