"""An einsum of activations by a weight as a batch of plain matrix products: the layout the custom product kernels
take (kernels/fixed_tiles.py on a GPU, kernels/cpu/cpu_rows.py on a CPU).

Each letter of the equation is a batch axis (in both operands and the output), a row axis (the activations and the
output), a column axis (the weight and the output) or contracted (both operands). The activations become [G, M, K]
and the weight [G, K, N], or [G, N, K] when it is already stored that way (an embedding read as a tied lm_head):
then it is read in place, as it is for a weight stored [.., K, N]. A quantized weight's scales (and mins) become
[G, KB, N]: one per output column and per block of K / KB consecutive contracting elements ([G, N, KB] for the CPU
kernel when the weight is read as [G, N, K]: as the scales lie then). A weight of packed 4-bit values is only read in
place: a free view of its bytes, [G, K, N / 2] or [G, N, K / 2].
"""

from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp

from mtp_jax.quant.quantized_array import QuantizedArray


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each letter of an equation goes: batch (G), rows (M), contracting (K) and columns (N) letters, the
    output's letters, every letter's size, and whether the weight is read as [G, N, K]."""

    lhs: str
    rhs: str
    out: str
    batch: tuple[str, ...]
    rows: tuple[str, ...]
    contract: tuple[str, ...]
    cols: tuple[str, ...]
    size: dict
    transposed: bool

    def extent(self, letters) -> int:
        return math.prod(self.size[c] for c in letters)

    @property
    def gmkn(self) -> tuple[int, int, int, int]:
        return tuple(self.extent(letters) for letters in (self.batch, self.rows, self.contract, self.cols))


def layout(equation: str, a_shape, b_shape) -> Layout:
    """The Layout of `equation` (a's subscripts may start with "...") for operands of these shapes."""
    equation = explicit(equation, len(a_shape))
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    batch = tuple(c for c in rhs if c in lhs and c in out)
    rows = tuple(c for c in lhs if c not in rhs)
    cols = tuple(c for c in rhs if c not in lhs)
    contract = tuple(c for c in rhs if c in lhs and c not in out)
    size = dict(zip(lhs, a_shape, strict=True)) | dict(zip(rhs, b_shape, strict=True))
    transposed = rhs == "".join(batch + cols + contract)
    return Layout(lhs, rhs, out, batch, rows, contract, cols, size, transposed)


def explicit(equation: str, ndim: int) -> str:
    """The equation with a leading "..." of the first operand (and of the output) spelled out in unused letters."""
    if "..." not in equation:
        return equation
    lhs = equation.split(",")[0]
    free = [c for c in string.ascii_letters if c not in equation]
    ellipsis = "".join(free[: ndim - len(lhs.replace("...", ""))])
    return equation.replace("...", ellipsis)


def activations(lay: Layout, a: jax.Array) -> jax.Array:
    """a -> [G, M, K]."""
    g, m, k, _ = lay.gmkn
    return jnp.einsum(f"{lay.lhs}->{''.join(lay.batch + lay.rows + lay.contract)}", a).reshape(g, m, k)


def weight(lay: Layout, b: jax.Array, packed: bool = False) -> jax.Array:
    """b -> [G, K, N], or [G, N, K] when `lay.transposed` (then, like a weight stored [.., K, N], a free view);
    `packed` b (two 4-bit values a byte along its last axis, see `reads_in_place`) -> its bytes in that shape, the
    last axis halved."""
    g, _, k, n = lay.gmkn
    order = weight_order(lay)
    shape = (g, n, k) if lay.transposed else (g, k, n)
    if packed:
        return b.reshape(*shape[:2], shape[2] // 2)
    return jnp.einsum(f"{lay.rhs}->{order}", b).reshape(shape)


def weight_order(lay: Layout) -> str:
    """The weight's letters in the order the kernels read them."""
    return "".join(lay.batch + (lay.cols + lay.contract if lay.transposed else lay.contract + lay.cols))


def reads_in_place(lay: Layout) -> bool:
    """Whether the weight's axes are already in the kernels' order (`weight` is then a reshape)."""
    return lay.rhs == weight_order(lay)


def output(lay: Layout, product: jax.Array) -> jax.Array:
    """product [G, M, N] -> the equation's output."""
    product = product.reshape([lay.size[c] for c in lay.batch + lay.rows + lay.cols])
    return jnp.einsum(f"{''.join(lay.batch + lay.rows + lay.cols)}->{lay.out}", product)


def contracting_blocks(lay: Layout, w: QuantizedArray) -> int | None:
    """KB, the number of scale blocks along the flattened contracting axes (1: one scale per output column); None
    when those blocks are not contiguous runs of the flattened axes. From shapes alone: no op is traced."""
    counts = dict(zip(lay.rhs, w.scales.shape, strict=True))
    per_element = [counts[c] == lay.size[c] for c in lay.contract] + [False]
    first = per_element.index(False)  # axes before it: a scale per element; after it: one scale along the axis
    if any(counts[c] != 1 for c in lay.contract[first + 1 :]):
        return None
    return math.prod(counts[c] for c in lay.contract)


def scales(lay: Layout, w: QuantizedArray, array: jax.Array | None = None, columns_first: bool = False):
    """w's scales (or `array` shaped as them: its mins) as [G, KB, N], or as [G, N, KB] with `columns_first` (see
    the module docstring); None where `contracting_blocks` is."""
    kb = contracting_blocks(lay, w)
    if kb is None:
        return None
    counts = dict(zip(lay.rhs, w.scales.shape, strict=True))
    expanded = w.scales if array is None else array
    for axis, letter in enumerate(lay.rhs):  # output columns and batch axes: a scale per element
        if letter not in lay.contract and counts[letter] != lay.size[letter]:
            expanded = jnp.repeat(expanded, lay.size[letter] // counts[letter], axis=axis)
    order = lay.batch + ((lay.cols + lay.contract) if columns_first else (lay.contract + lay.cols))
    expanded = jnp.einsum(f"{lay.rhs}->{''.join(order)}", expanded)
    g, n = lay.extent(lay.batch), lay.extent(lay.cols)
    return expanded.reshape((g, n, kb) if columns_first else (g, kb, n))
