"""The CPU's measured choice in the execution plan (config/execution_plan.py, kernels/cpu/kernel_choice.py): outside
batch-invariant decoding a product takes the CPU row kernel only where the kernel beat XLA's form in the table for its
weight form and row count (the plan's `kernel_loses`); under it, always; the table is timed outside any trace, each
form both ways, [K, N] and [N, K] apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import execution_plan
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.cpu import cpu_rows, kernel_choice
from mtp_jax.kernels.dispatch import project
from mtp_jax.quant import int8

pytestmark = pytest.mark.skipif(cpu_rows.status() != "ready", reason=f"CPU row kernel: {cpu_rows.status()}")


def _table(kernel_faster_at: set[int]) -> dict:
    """float32 measured: the kernel faster at these row counts, XLA at the others."""
    rows = {str(r): {"kernel_us": 1.0 if r in kernel_faster_at else 3.0, "xla_us": 2.0} for r in kernel_choice.ROWS}
    return {"float32": rows}


def _takes_kernel(plan, x: jax.Array, weight, equation: str = "MD,DN->MN") -> bool:
    with traced_plan.tracing(plan):
        return "ffi_call" in str(jax.make_jaxpr(lambda x, w: project(equation, x, w))(x, weight))


def test_a_product_takes_the_kernel_where_it_won(monkeypatch):
    monkeypatch.setenv(kernel_choice.DISABLE_ENV, "1")
    monkeypatch.setattr(cpu_rows, "choice_table", lambda: _table({1, 2}))
    plan = traced_plan.resolve()
    assert plan.kernel_loses == ("float32@4", "float32@8", "float32@16", "float32@64")
    weight = jnp.ones((64, 96), jnp.float32)
    assert _takes_kernel(plan, jnp.ones((1, 64)), weight)
    assert _takes_kernel(plan, jnp.ones((2, 64)), weight)
    assert not _takes_kernel(plan, jnp.ones((3, 64)), weight)  # the verdict at 4 rows: XLA
    invariant = traced_plan.resolve(invariant=True)  # batch-invariant decoding needs the kernel's bits
    assert invariant.kernel_loses == () and _takes_kernel(invariant, jnp.ones((3, 64)), weight)
    int8_weight = int8.quantize_int8(jnp.ones((64, 96)), (0,))  # a form the table does not hold: the kernel
    assert _takes_kernel(plan, jnp.ones((3, 64)), int8_weight)
    monkeypatch.setenv(kernel_choice.DISABLE_ENV, "0")  # no choice: the kernel wherever it runs
    assert _takes_kernel(traced_plan.resolve(), jnp.ones((3, 64)), weight)
    xla = execution_plan.xla_only("cpu")  # a plan without the kernel: none of it
    assert not _takes_kernel(xla, jnp.ones((1, 64)), weight)


@pytest.mark.slow
def test_every_form_is_recognised():
    rng = np.random.default_rng(0)
    for form in kernel_choice.FORMS:
        assert kernel_choice.form_of(kernel_choice.timed_weight(form, rng)) == form
    for form in kernel_choice.TRANSPOSED_FORMS:
        weight = kernel_choice.timed_weight(form, rng, transposed=True)
        assert kernel_choice.form_of(weight) == form
        x = jnp.ones((1, kernel_choice.SHAPE[0]))
        assert cpu_rows.takes(kernel_choice.TRANSPOSED, x, weight, invariant=False)  # the kernel reads it [N, K]


def test_a_transposed_product_takes_its_own_verdict(monkeypatch):
    """A tied lm_head reads the embedding [V, D] by the kernel's other loop: the [K, N] timing says nothing of it."""
    monkeypatch.setenv(kernel_choice.DISABLE_ENV, "1")
    kernel_faster = {str(r): {"kernel_us": 1.0, "xla_us": 2.0} for r in kernel_choice.ROWS}
    xla_faster = {str(r): {"kernel_us": 3.0, "xla_us": 2.0} for r in kernel_choice.ROWS}
    table = {"float32": kernel_faster, "float32" + kernel_choice.TRANSPOSED_KEY: xla_faster}
    monkeypatch.setattr(cpu_rows, "choice_table", lambda: table)
    x = jnp.ones((1, 64))
    assert _takes_kernel(traced_plan.resolve(), x, jnp.ones((64, 96), jnp.float32))
    assert not _takes_kernel(traced_plan.resolve(), x, jnp.ones((96, 64)), "MD,ND->MN")
    table["float32" + kernel_choice.TRANSPOSED_KEY] = kernel_faster
    assert _takes_kernel(traced_plan.resolve(), x, jnp.ones((96, 64)), "MD,ND->MN")


@pytest.mark.slow
def test_the_table_is_timed_outside_the_trace_that_asks_for_it(monkeypatch):
    monkeypatch.setattr(kernel_choice, "ROWS", (1, 2))
    monkeypatch.setattr(kernel_choice, "FORMS", ("q4_1",))
    monkeypatch.setattr(kernel_choice, "TRANSPOSED_FORMS", ("q8_0",))
    monkeypatch.setattr(kernel_choice, "SHAPE", (64, 96))
    monkeypatch.setattr(kernel_choice, "CALLS", 2)
    measured = []

    def traced(x):  # asked for while a program is traced (a plan resolved inside a user's jit)
        run = lambda: kernel_choice.measure(cpu_rows.einsum, cpu_rows.xla_float32)
        measured.append(kernel_choice.outside_any_trace(run))
        return x + 1

    jaxpr = jax.make_jaxpr(traced)(jnp.ones(3))
    assert len(jaxpr.eqns) == 1  # the add alone: no timed call was staged into the program being traced
    table = measured[0]
    assert set(table) == {"q4_1", "q8_0 [N, K]"} and all(set(t) == {"1", "2"} for t in table.values())
    for verdict in [*table["q4_1"].values(), *table["q8_0 [N, K]"].values()]:
        assert verdict["kernel_us"] > 0 and verdict["xla_us"] > 0


def test_timing_inside_the_trace_would_stage_the_calls():
    """The failure `outside_any_trace` prevents (so the test above can fail)."""
    weight = kernel_choice.timed_weight("float32", np.random.default_rng(0))
    call = jax.jit(lambda x: cpu_rows.einsum("MK,KN->MN", x, weight))
    jaxpr = jax.make_jaxpr(lambda x: (call(jnp.ones((1, weight.shape[0]))), x + 1)[1])(jnp.ones(3))
    assert len(jaxpr.eqns) > 1
