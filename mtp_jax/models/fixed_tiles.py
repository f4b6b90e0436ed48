"""Products whose every output element is summed in one fixed order, whatever the shape of the pass: the matmuls of
batch-invariant decoding on a GPU.

XLA's GPU compiler picks a matmul's kernel by shape (cuBLAS or a Triton tiling, with or without a split of the
contracting axis), and those kernels add a row's products in other orders. Measured on an H100 with the default
model in bfloat16: under `DecodeConfig(invariant=True)` MTP k = 2 and 3 equalled plain decoding (passes of 24 and 32
rows) while k = 1 (16 rows) and a lone prompt (2 rows) did not (docs/benchmarks.md, "One H100").

Here every product is one Pallas kernel with fixed tiles: a program per tile of BLOCK_M rows by BLOCK_N outputs,
each walking the contracting axis in steps of BLOCK_K and adding each step's tile product to a float32
accumulator. An output element's sum then depends only on its own row and column: the same tiles, in the same
order, with the same instructions, for 1 row or 10 000 (rows are padded to whole tiles with zeros, which add
nothing to another row). On a GPU the kernel is compiled by Triton; elsewhere it runs in Pallas' interpreter (for
tests; slow).

`invariant_products(on)` turns it on while a decode program is traced: `rowwise.project` and `rowwise.product` then
use it on a GPU without a mesh of several devices (a custom kernel is not split by XLA's partitioner). A weight
stored int8 or fp8 goes in dequantized (a copy of it in the model's dtype each pass: the mode's tokens do not depend
on the pass, but it reads more bytes than the stored weight; a dequantizing load in the kernel would not).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import string
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mtp_jax.sharding import active_platform, active_rules

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
PLATFORMS = ("gpu",)  # where batch-invariant decoding uses these kernels
_IN_USE: contextvars.ContextVar[bool] = contextvars.ContextVar("mtp_jax_fixed_tiles", default=False)


@contextlib.contextmanager
def invariant_products(on: bool) -> Iterator[None]:
    """While tracing inside this block, the products of `rowwise` use fixed tiles when `on`, on a platform of
    PLATFORMS, with no mesh of several devices active."""
    rules = active_rules()
    token = _IN_USE.set(on and active_platform() in PLATFORMS and (rules is None or rules.mesh.size == 1))
    try:
        yield
    finally:
        _IN_USE.reset(token)


def in_use() -> bool:
    return _IN_USE.get()


def einsum(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(equation, a, b) in float32, each output element summed in a fixed order (module docstring).
    Each letter of the equation is a batch axis (in a, b and the output), a row axis (a and the output), a column
    axis (b and the output) or contracted (a and b); `a` may start with "...". b is read in place when its axes
    are already batch, contracting, columns or batch, columns, contracting (a weight [D, V] or an embedding [V, D]);
    otherwise it is transposed first."""
    equation = _explicit(equation, a.ndim)
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    batch = [c for c in rhs if c in lhs and c in out]
    rows = [c for c in lhs if c not in rhs]
    cols = [c for c in rhs if c not in lhs]
    contract = [c for c in rhs if c in lhs and c not in out]
    size = dict(zip(lhs, a.shape, strict=True)) | dict(zip(rhs, b.shape, strict=True))
    g, m, k, n = (math.prod(size[c] for c in letters) for letters in (batch, rows, contract, cols))
    a = jnp.einsum(f"{lhs}->{''.join(batch + rows + contract)}", a).reshape(g, m, k)
    transposed = rhs == "".join(batch + cols + contract)
    order = batch + (cols + contract if transposed else contract + cols)
    b = jnp.einsum(f"{rhs}->{''.join(order)}", b).reshape(g, *((n, k) if transposed else (k, n)))
    product = matmul(a, b.astype(a.dtype), transposed, interpret=active_platform() != "gpu")  # [G, M, N]
    product = product.reshape([size[c] for c in batch + rows + cols])
    return jnp.einsum(f"{''.join(batch + rows + cols)}->{out}", product)


def _explicit(equation: str, ndim: int) -> str:
    """The equation with a leading "..." of the first operand (and of the output) spelled out in unused letters."""
    if "..." not in equation:
        return equation
    lhs = equation.split(",")[0]
    free = [c for c in string.ascii_letters if c not in equation]
    ellipsis = "".join(free[: ndim - len(lhs.replace("...", ""))])
    return equation.replace("...", ellipsis)


@functools.partial(jax.jit, static_argnames=("transposed", "interpret"))
def matmul(a: jax.Array, b: jax.Array, transposed: bool = False, interpret: bool = False) -> jax.Array:
    """a [G, M, K] @ b [G, K, N] (b [G, N, K] when `transposed`) -> float32 [G, M, N], with fixed tiles."""
    g, m, k = a.shape
    n = b.shape[1] if transposed else b.shape[2]
    padded = -(-m // BLOCK_M) * BLOCK_M
    a = jnp.pad(a, ((0, 0), (0, padded - m), (0, 0)))  # whole row tiles; zero rows add nothing to another row
    b_block = (None, BLOCK_N, k) if transposed else (None, k, BLOCK_N)
    out = pl.pallas_call(
        functools.partial(_tile_kernel, k_size=k, n_size=n, transposed=transposed),
        out_shape=jax.ShapeDtypeStruct((g, padded, n), jnp.float32),
        grid=(g, padded // BLOCK_M, pl.cdiv(n, BLOCK_N)),
        in_specs=[
            pl.BlockSpec((None, BLOCK_M, k), lambda i, r, c: (i, r, 0)),
            pl.BlockSpec(b_block, (lambda i, r, c: (i, c, 0)) if transposed else (lambda i, r, c: (i, 0, c))),
        ],
        out_specs=pl.BlockSpec((None, BLOCK_M, BLOCK_N), lambda i, r, c: (i, r, c)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(a, b)
    return out[:, :m]


def _tile_kernel(a_ref, b_ref, out_ref, *, k_size: int, n_size: int, transposed: bool):
    """One [BLOCK_M, BLOCK_N] tile of the product: a_ref [BLOCK_M, K], b_ref [K, BLOCK_N] ([BLOCK_N, K] when
    transposed; its last tile may run past N), the contracting axis in steps of BLOCK_K, in order."""
    cols = pl.program_id(2) * BLOCK_N + jnp.arange(BLOCK_N)
    col_ok = cols < n_size  # [BLOCK_N]
    precision = jax.lax.Precision.HIGHEST if a_ref.dtype == jnp.float32 else None  # float32: no TF32 rounding

    def step(i, acc):  # acc [BLOCK_M, BLOCK_N] float32
        depth = i * BLOCK_K + jnp.arange(BLOCK_K)
        k_ok = depth < k_size  # [BLOCK_K]
        a = plgpu.load(a_ref.at[:, pl.ds(i * BLOCK_K, BLOCK_K)], mask=k_ok[None, :], other=0)
        if transposed:
            b = plgpu.load(b_ref.at[:, pl.ds(i * BLOCK_K, BLOCK_K)], mask=col_ok[:, None] & k_ok[None, :], other=0)
            return acc + plgpu.dot(a, b, trans_b=True, precision=precision)
        b = plgpu.load(b_ref.at[pl.ds(i * BLOCK_K, BLOCK_K), :], mask=k_ok[:, None] & col_ok[None, :], other=0)
        return acc + plgpu.dot(a, b, precision=precision)

    acc = jax.lax.fori_loop(0, pl.cdiv(k_size, BLOCK_K), step, jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32))
    plgpu.store(out_ref, acc, mask=col_ok[None, :])
