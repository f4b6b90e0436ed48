"""The execution plan for here (`resolve`: from the mesh, batch-invariance, the kernels built on this machine and the
CPU's measured choice) and the plan of the program traced now (`tracing`, `current`). The plan's value and its
members: config/execution_plan.py."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import jax

from mtp_jax.config.execution_plan import (
    DecodeAttention,
    DeltaRule,
    ExecutionPlan,
    LargePassExperts,
    Products,
    SmallPassExperts,
    VerifyLogits,
)
from mtp_jax.kernels import fixed_tiles
from mtp_jax.kernels.cpu import cpu_rows, kernel_choice
from mtp_jax.parallel.sharding import active_rules, mesh_platform


def resolve(rules=None, invariant: bool = False) -> ExecutionPlan:
    """The plan for a program run under sharding `rules` (None: the default backend's one device) here, each
    member's choice written out: custom calls only on one device (XLA's partitioner does not split them); on a CPU
    the row kernel and its attention where they are built, its products only where they beat XLA's here (outside
    batch-invariant decoding); a GPU's fixed tiles for batch-invariant products; a TPU's Pallas kernels for routed
    experts and the delta rule."""
    platform = mesh_platform(rules.mesh) if rules is not None else jax.default_backend()
    one_device = rules is None or rules.mesh.size == 1
    tpu = platform == "tpu"
    cpu_kernel = platform == "cpu" and one_device and cpu_rows.status() == "ready"
    if platform in fixed_tiles.PLATFORMS and one_device and invariant:
        products = Products.FIXED_TILES
    else:
        products = Products.CPU_ROWS if cpu_kernel else Products.XLA
    measured = products is Products.CPU_ROWS and not invariant and os.environ.get(kernel_choice.DISABLE_ENV) != "0"
    return ExecutionPlan(
        platform,
        one_device,
        invariant,
        products=products,
        attention=DecodeAttention.CPU_KERNEL if cpu_kernel else DecodeAttention.XLA,
        small_experts=SmallPassExperts.PALLAS if tpu else SmallPassExperts.GATHER,
        large_experts=LargePassExperts.PALLAS_GROUPED if tpu else LargePassExperts.RAGGED_DOT,
        delta_rule=DeltaRule.PALLAS if tpu else DeltaRule.XLA_SCAN,
        verify_logits=VerifyLogits.ROW_BY_ROW if products is Products.CPU_ROWS else VerifyLogits.BLOCK,
        kernel_loses=kernel_choice.losing_products(cpu_rows.choice_table()) if measured else (),
    )


_TRACED: contextvars.ContextVar[ExecutionPlan | None] = contextvars.ContextVar("mtp_jax_plan", default=None)


@contextlib.contextmanager
def tracing(plan: ExecutionPlan) -> Iterator[ExecutionPlan]:
    """Trace inside this block under `plan` (the layers read it: `current`)."""
    token = _TRACED.set(plan)
    try:
        yield plan
    finally:
        _TRACED.reset(token)


def current() -> ExecutionPlan:
    """The plan of the program traced now (`tracing`), else the plan for here (ops outside a decode program)."""
    return _TRACED.get() or resolve(active_rules())
