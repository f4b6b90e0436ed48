"""Projections and sums whose every row comes out the same whatever else shares the pass.

A decode step multiplies B * T rows of activations by each weight: 1 row for a plain step at batch 1, B * (k + 1)
for a verify block, thousands for a prefill. Backends pick a matmul algorithm by shape, and a row's float32 sums
then depend on how many rows came with it. Measured on XLA:CPU: a one-row product runs a matrix-vector kernel whose
sums differ from those of every product of 2 or more rows, and a bfloat16 product rounded to bfloat16 inside the dot
differs again between 32 and 40 rows; with bfloat16 operands and float32 results, every product of 2 to 4096 rows
gave each row bit for bit the same sums, wherever the row sat, and ran faster there than a bfloat16-out dot (measured:
docs/benchmarks-log.md#bfloat16-invariance-mtp-equal-to-plain-and-the-same-tokens-at-any-batch-size-cpu).

So every projection here takes float32 results (`preferred_element_type`) and rounds once to the activations'
dtype. A projection goes to the kernel ops/dispatch.py picks for it: on a CPU the row kernel (kernels/cpu/cpu_rows.py:
a decode step's few rows where it won against XLA's form here; every pass under batch-invariant decoding), one fixed
order of sums per output element for 1 row or many, and the weight read as stored; XLA's form (`xla_project`)
elsewhere. Where no such kernel is built (no C++ compiler), batch-invariant decoding never makes a one-row pass: it
decodes a lone prompt beside a copy of itself (`speculative.generate`, `lone_rows_exact`).

Sums along a row (a norm's mean square, a softmax's total) are reductions, and XLA picks a reduction's order by
shape too: on XLA:CPU the float32 mean square of 576 values came out differently for 1, 2, 4 and 8 rows in most of
200 random trials. `row_sum` adds halves elementwise instead, a fixed tree whatever the number of rows.

On a GPU, XLA's own matmul kernels differ by shape in ways a float32 result does not undo; while a batch-invariant
decode is traced (`dispatch.tracing(True)`), every product here runs through fixed tiles instead
(kernels/fixed_tiles.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.ops import dispatch, matmul_layout
from mtp_jax.ops.stacked_weights import layer_value
from mtp_jax.quant.blocked_product import quantized_einsum
from mtp_jax.quant.int8_activations import activations_rounded_to_int8
from mtp_jax.quant.quantized_array import QuantizedArray

DEQUANTIZED_ROWS = 64  # a pass of more rows multiplies by a quantized weight dequantized first


def project(equation: str, x: jax.Array, weight: jax.Array | QuantizedArray, out_dtype=None) -> jax.Array:
    """jnp.einsum(equation, x, weight) with float32 results rounded to `out_dtype` (default: x's dtype); a weight
    stored quantized goes in as stored (`quant.quantized_einsum`: pass the parameter's value, not `param[...]`,
    which dequantizes), or dequantized first in a pass of many rows (`_dequantized_first`); a StackedWeight (a layer
    of a stack, ops/stacked_weights.py) is read in place by a kernel that can, taken out of its stack elsewhere.
    The kernel is the one ops/dispatch.py picks; XLA's form (`xla_project`) where none takes the product.
    x's axes that the weight does not share are its rows (e.g. "BTD,DNH->BTNH": B * T rows; "...D,DV->...V": every
    leading axis; "EMF,EFD->EMD": M rows for each E). A batch of matmuls (an axis of x and the weight that the output
    keeps, e.g. latent attention's per-head absorption) keeps x's dtype out, as plain einsum does: XLA:CPU has no
    bfloat16 x bfloat16 -> float32 kernel for it in some layouts."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    implementation = dispatch.product_implementation(equation, x, weight)
    if implementation is None:
        return xla_project(equation, x, weight, out_dtype)
    return implementation.run(equation, x, weight, out_dtype)


def xla_project(equation: str, x: jax.Array, weight, out_dtype) -> jax.Array:
    """`project` in XLA's own ops (a StackedWeight taken out of its stack)."""
    weight = layer_value(weight)
    if isinstance(weight, QuantizedArray) and not _dequantized_first(equation, x, weight):
        return quantized_einsum(equation, x, weight).astype(out_dtype)  # the stored values in the matmul
    if isinstance(weight, QuantizedArray):
        x, weight = rows_as_read(equation, x, weight), weight.dequantize()
    if _batched(equation) and out_dtype == x.dtype:
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


def _dequantized_first(equation: str, x: jax.Array, weight: QuantizedArray) -> bool:
    """Whether a product by a quantized weight dequantizes the weight first (in the model's dtype, one layer's
    weight at a time) and multiplies by it: passes of more than DEQUANTIZED_ROWS rows (prefills), where the product
    is compute-bound and one partial product per block of 32 contracting elements ran at a fraction of a GEMM's
    speed (measured:
    docs/benchmarks-log.md#layers-read-in-place-from-their-stacks-prefills-through-dequantized-weights-cpu).
    Never while a batch-invariant decode is traced: a prompt's rows would take another path alone than in a batch.
    Nor for a batch of matrices (routed experts, "EMF,EFD->EMD"): a layer's every expert dequantized at once could
    be gigabytes."""
    if dispatch.current().invariant:
        return False
    g, m, _, _ = matmul_layout.layout(equation, x.shape, weight.shape).gmkn
    return g == 1 and m > DEQUANTIZED_ROWS


ROW_KERNELS = ("fixed_tiles", "cpu_rows")  # kernels whose every row's sums are its own, whatever the pass


def lone_rows_exact() -> bool:
    """Whether a pass of a single row gets the sums it gets inside a batch, under batch-invariant decoding traced
    now: with a kernel of ROW_KERNELS (a GPU's fixed tiles, the CPU's row kernel). Elsewhere `speculative.generate`
    decodes a lone prompt beside a copy of itself."""
    return any(dispatch.current().has(kernel) for kernel in ROW_KERNELS)


def attention_rows_exact(dtype) -> bool:
    """Whether batch-invariant attention traced now can give each row its sums alone (`row_product`): with the CPU
    row kernel, one device, operands (the cache read in the queries' dtype) of float32 or bfloat16. Elsewhere a lone
    row attends beside a copy of itself (`cache_attention.two_rows`): XLA:CPU drops a batch axis of one."""
    kernel_dtype = any(jnp.dtype(dtype) == d for d in (jnp.float32, jnp.bfloat16))
    return kernel_dtype and dispatch.current().has("cpu_rows")


def row_product(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`product` by the CPU row kernel (call where `attention_rows_exact` said yes): each output element one fixed
    chain of sums whatever the pass's batch, rows or tokens."""
    return dispatch.registered_product("cpu_rows").run(equation, a, b, jnp.float32)


def _fixed_tiles() -> dispatch.Implementation | None:
    """The GPU's fixed tiles where batch-invariant decoding is traced with them, else None."""
    numerics = dispatch.current()
    return dispatch.registered_product("fixed_tiles") if numerics.invariant and numerics.has("fixed_tiles") else None


def float32_product(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(equation, a, b) with float32 results. On XLA:CPU from float32 operands: its batched matmul has
    no bfloat16 x bfloat16 -> float32 kernel in some layouts (latent attention's probabilities times latents failed
    to run), and a product of two bfloat16 values is exact in float32, so only the order of the float32 sums may
    differ. Elsewhere the operands stay as given."""
    tiles = _fixed_tiles()
    if tiles is not None:
        return tiles.run(equation, a, b, jnp.float32)
    if dispatch.current().platform == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def product(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(equation, a, b) with float32 results (operands as given): attention's scores and outputs."""
    tiles = _fixed_tiles()
    if tiles is not None:
        return tiles.run(equation, a, b, jnp.float32)
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def _batched(equation: str) -> bool:
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
