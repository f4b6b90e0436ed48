"""Where an operation meets its implementation: the member of the execution plan traced now for it
(config/execution_plan.py), run by the kernel that member names where that kernel reads these operands, else XLA's
form. Each function below is the whole choice for one operation, written out: no registry, no order of preference.

The models call the operations here: projections (`project`), attention's products (`product`, `float32_product`,
`row_product`), and through the `*_implementation` functions, decode attention, routed experts and the delta rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mtp_jax.config.execution_plan import DecodeAttention, DeltaRule, LargePassExperts, Products, SmallPassExperts
from mtp_jax.kernels import delta_rule_kernel, fixed_tiles, grouped_kernel, routed_kernel
from mtp_jax.kernels.cpu import cpu_attention, cpu_rows, kernel_choice
from mtp_jax.kernels.traced_plan import current
from mtp_jax.ops.rowwise import xla_project
from mtp_jax.quant.quantized_array import QuantizedArray


def project(equation: str, x: jax.Array, weight: jax.Array | QuantizedArray, out_dtype=None) -> jax.Array:
    """jnp.einsum(equation, x, weight) with float32 results rounded to `out_dtype` (default: x's dtype); a weight
    stored quantized goes in as stored (`quant.quantized_einsum`: pass the parameter's value, not `param[...]`,
    which dequantizes), or dequantized first in a pass of many rows (`rowwise.dequantized_first`); a StackedWeight
    (a layer of a stack, ops/stacked_weights.py) is read in place by a kernel that can, taken out of its stack
    elsewhere. The kernel is the one the plan traced now names (`product_implementation`); XLA's form
    (`rowwise.xla_project`) where it names none or the kernel declines the product.
    x's axes that the weight does not share are its rows (e.g. "BTD,DNH->BTNH": B * T rows; "...D,DV->...V": every
    leading axis; "EMF,EFD->EMD": M rows for each E). A batch of matmuls (an axis of x and the weight that the output
    keeps, e.g. latent attention's per-head absorption) keeps x's dtype out, as plain einsum does: XLA:CPU has no
    bfloat16 x bfloat16 -> float32 kernel for it in some layouts."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    run = product_implementation(equation, x, weight)
    if run is None:
        return xla_project(equation, x, weight, out_dtype, current().invariant)
    return run(equation, x, weight, out_dtype)


def product_implementation(equation: str, x: jax.Array, weight: Any) -> Callable | None:
    """`run(equation, x, weight, out_dtype)` for this product under the plan traced now, or None (XLA's form)."""
    plan = current()
    if plan.products is Products.FIXED_TILES:
        return fixed_tiles.run_product
    if plan.products is Products.CPU_ROWS and cpu_rows.takes(equation, x, weight, plan.invariant):
        if plan.invariant or cpu_rows.tiled(weight):  # (XLA would read a weight in tile order permuted back)
            return cpu_rows.run_product
        if kernel_choice.product_key(equation, x, weight) not in plan.kernel_loses:
            return cpu_rows.run_product
    return None


def lone_rows_exact() -> bool:
    """Whether a pass of a single row gets the sums it gets inside a batch, under batch-invariant decoding traced
    now: with products whose every row's sums are its own (a GPU's fixed tiles, the CPU's row kernel). Elsewhere
    `speculative.generate` decodes a lone prompt beside a copy of itself."""
    return current().products in (Products.FIXED_TILES, Products.CPU_ROWS)


def attention_rows_exact(dtype) -> bool:
    """Whether batch-invariant attention traced now can give each row its sums alone (`row_product`): under a plan
    whose decode attention is the CPU kernel (its library's row products serve the XLA form too), operands (the
    cache read in the queries' dtype) of float32 or bfloat16. Elsewhere a lone row attends beside a copy of itself
    (`cache_attention.two_rows`): XLA:CPU drops a batch axis of one."""
    kernel_dtype = any(jnp.dtype(dtype) == d for d in (jnp.float32, jnp.bfloat16))
    return kernel_dtype and current().attention is DecodeAttention.CPU_KERNEL


def row_product(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`product` by the CPU row kernel (call where `attention_rows_exact` said yes): each output element one fixed
    chain of sums whatever the pass's batch, rows or tokens."""
    return cpu_rows.run_product(equation, a, b, jnp.float32)


def _fixed_tiles() -> bool:
    """Whether attention's products run in the GPU's fixed tiles: batch-invariant decoding traced with them."""
    plan = current()
    return plan.invariant and plan.products is Products.FIXED_TILES


def float32_product(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(equation, a, b) with float32 results. On XLA:CPU from float32 operands: its batched matmul has
    no bfloat16 x bfloat16 -> float32 kernel in some layouts (latent attention's probabilities times latents failed
    to run), and a product of two bfloat16 values is exact in float32, so only the order of the float32 sums may
    differ. Elsewhere the operands stay as given."""
    if _fixed_tiles():
        return fixed_tiles.run_product(equation, a, b, jnp.float32)
    if current().platform == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def product(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(equation, a, b) with float32 results (operands as given): attention's scores and outputs."""
    if _fixed_tiles():
        return fixed_tiles.run_product(equation, a, b, jnp.float32)
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def attention_implementation(q: jax.Array, past_k: Any, shards: int, whole_pass: bool) -> Callable | None:
    """The CPU attention kernel's `attend` where the plan takes it and it reads these queries [B, T, N, H] over this
    cache, or None (XLA's forms). `whole_pass`: the batch-invariant form asks for every pass, prefills included."""
    plan = current()
    if plan.attention is DecodeAttention.CPU_KERNEL and cpu_attention.reads(q, past_k, shards, whole_pass):
        return cpu_attention.attend
    return None


def experts_implementation(x: jax.Array, ids: jax.Array, gate: Any, up: Any, down: Any,
                           manual: bool, small: bool) -> Callable | None:  # fmt: skip
    """`run(x, weights, ids, layer, gate, up, down)` for this pass's routed experts (rows x [M, D], local expert
    ids [M, O], the expert stacks [L, E, ...]) under the plan traced now, or None (every expert on every row for a
    small pass, XLA's grouped matmuls for a large one). `manual`: the pass runs on one device or inside the
    experts' shard_map (a custom call is not split by XLA's partitioner). `small`: a decode step or verify block of
    at most `moe.DENSE_EXPERT_ROWS` rows. Batch-invariant decoding keeps XLA's forms (models/moe.py)."""
    plan = current()
    if plan.invariant:
        return None
    if small and plan.small_experts is SmallPassExperts.PALLAS and manual:
        return routed_kernel.pallas_run if routed_kernel.kernel_tile(gate, up, down) is not None else None
    if small and plan.small_experts is SmallPassExperts.GATHER:
        return routed_kernel.gathered_experts if routed_kernel.gather_pays(x, ids, gate) else None
    if not small and plan.large_experts is LargePassExperts.PALLAS_GROUPED and manual:
        return grouped_kernel.run if grouped_kernel.kernel_fits(x, gate, up, down) else None
    return None


def delta_rule_implementation(k: jax.Array, state: jax.Array) -> Callable | None:
    """`run(q, k, v, g, beta, state, steps, final, parents=None)` for these keys [B, T, N, H] and states
    [B, N, H, Y] under the plan traced now, or None (XLA's scan)."""
    plan = current()
    fits = plan.platform != "tpu" or delta_rule_kernel.fits(k, state)  # Pallas' interpreter elsewhere reads any
    return delta_rule_kernel.run if plan.delta_rule is DeltaRule.PALLAS and fits else None
