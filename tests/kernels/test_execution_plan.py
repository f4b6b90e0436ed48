"""The execution plan (config/execution_plan.py, kernels/traced_plan.py): one printable value naming each
operation's implementation, resolved once, part of the decode program's key; checked against the programs it
compiles (which custom calls they hold), not against itself."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.config import execution_plan
from mtp_jax.config.execution_plan import DecodeAttention, ExecutionPlan, Products, VerifyLogits
from mtp_jax.decode import speculative
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.cpu import cpu_rows
from tests.support.prompts import padded_prompts
from tests.support.tiny_models import predictable_model

ROW_KERNEL_CALL = cpu_rows.TARGET  # the CPU row kernel's custom call in a lowered program
needs_kernel = pytest.mark.skipif(cpu_rows.status() != "ready", reason=f"CPU row kernel: {cpu_rows.status()}")


def _lowered(model, cfg) -> str:
    lens = np.array([2, 5], np.int32)
    prompts = padded_prompts(0, lens, model.config.vocab_size)
    graphdef, params = nnx.split(model)
    run = lambda p: mtp_jax.generate(nnx.merge(graphdef, p), prompts, lens, jax.random.key(0), cfg).tokens
    return jax.jit(run).lower(params).as_text()


@needs_kernel
def test_a_program_holds_the_kernels_its_plan_names_and_no_other():
    """The same decode under the CPU's plan and under XLA's: only the first lowers to the row kernel's calls."""
    model = predictable_model()
    here = traced_plan.resolve()
    assert here.products is Products.CPU_ROWS and here.attention is DecodeAttention.CPU_KERNEL
    with_kernel = _lowered(model, mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=6, plan=here))
    without = _lowered(model, mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=6, plan=execution_plan.xla_only("cpu")))
    assert ROW_KERNEL_CALL in with_kernel and cpu_rows.ATTENTION_TARGET in with_kernel
    assert ROW_KERNEL_CALL not in without and cpu_rows.ATTENTION_TARGET not in without


@needs_kernel
def test_two_runs_that_differ_only_in_their_plan_compile_two_programs():
    """`generate`'s jitted program takes the plan as static configuration: a second plan is a second program, and
    the same plan again reuses the first."""
    model = predictable_model(seed=3)
    lens = np.array([3, 1], np.int32)
    prompts = padded_prompts(1, lens, model.config.vocab_size)
    decode = lambda plan: mtp_jax.generate(
        model, prompts, lens, jax.random.key(0), mtp_jax.DecodeConfig(num_draft=1, max_new_tokens=5, plan=plan)
    )
    programs = speculative._generate._cache_size  # the jitted loop's compiled programs (a test's look inside)
    before = programs()
    decode(traced_plan.resolve())
    decode(execution_plan.xla_only("cpu"))
    assert programs() == before + 2
    decode(traced_plan.resolve())
    decode(None)  # the plan `generate` resolves for here: the first one
    assert programs() == before + 2


@pytest.mark.slow
@needs_kernel
def test_a_greedy_verify_takes_its_logits_row_by_row_where_its_plan_says():
    """The CPU's plan makes a lone row's verify logits a position at a time (one more loop in the program, its
    lm_head inside it), for blocks of ROW_BY_ROW_DRAFTS drafts or more, and a tree's along its accepted path only;
    the tokens and counters are the block's, and plain decoding's."""
    model = predictable_model(seed=5)
    here = traced_plan.resolve()
    assert here.verify_logits is VerifyLogits.ROW_BY_ROW
    block = dataclasses.replace(here, verify_logits=VerifyLogits.BLOCK)
    lens = np.array([4], np.int32)
    prompts = padded_prompts(2, lens, model.config.vocab_size)
    outputs, loops = {}, {}
    graphdef, params = nnx.split(model)
    runs = {  # name: (plan, drafts, tree nodes)
        "chain": (here, 3, 0), "chain, block": (block, 3, 0), "plain": (here, 0, 0), "two drafts": (here, 2, 0),
        "two drafts, block": (block, 2, 0), "tree": (here, 3, 8), "tree, block": (block, 3, 8),
    }  # fmt: skip
    for name, (plan, k, tree) in runs.items():
        cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=12, stop_on_eos=False, plan=plan, tree=tree)
        outputs[name] = mtp_jax.generate(model, prompts, lens, jax.random.key(0), cfg)
        run = lambda p, cfg=cfg: mtp_jax.generate(nnx.merge(graphdef, p), prompts, lens, jax.random.key(0), cfg)
        loops[name] = jax.jit(run).lower(params).as_text().count("stablehlo.while")
    assert loops["two drafts"] == loops["two drafts, block"]  # a block of three rows stays whole
    for name in ("chain", "tree"):
        assert loops[name] == loops[f"{name}, block"] + 1
        for plan in (name, f"{name}, block"):
            np.testing.assert_array_equal(np.asarray(outputs[plan].tokens), np.asarray(outputs["plain"].tokens))
        for field in ("rounds", "accepted", "reached", "accepted_at"):
            np.testing.assert_array_equal(getattr(outputs[name].stats, field),
                                          getattr(outputs[f"{name}, block"].stats, field))  # fmt: skip
        assert int(outputs[name].stats.accepted) > 0


def test_generate_resolves_the_plan_before_it_traces():
    """A config without a plan gets the one for the model's mesh here (batch-invariant where the config is)."""
    model = predictable_model()
    for invariant in (False, True):
        cfg = speculative.checked_decode_config(model, mtp_jax.DecodeConfig(num_draft=1, invariant=invariant))
        assert cfg.plan == traced_plan.resolve(invariant=invariant)


def test_a_plan_prints_its_choices_and_refuses_what_cannot_run():
    plan = dataclasses.replace(
        execution_plan.xla_only("cpu"), products=Products.CPU_ROWS, kernel_loses=("float32@64", "int8@16")
    )
    line = plan.summary()
    for part in ("cpu, one device", "products cpu_rows (XLA where it won: float32@64, int8@16)", "decode attention xla",
                 "routed experts every_expert / ragged_dot", "delta rule xla_scan", "verify logits block"):  # fmt: skip
        assert part in line, line
    assert json.loads(json.dumps(plan.as_dict()))["kernel_loses"] == ["float32@64", "int8@16"]
    assert "batch-invariant" in execution_plan.xla_only("gpu", invariant=True).summary()
    with pytest.raises(ValueError, match="several devices"):
        ExecutionPlan("cpu", one_device=False, products=Products.CPU_ROWS)
    with pytest.raises(ValueError, match="platform"):
        ExecutionPlan("xpu")
    with pytest.raises(ValueError, match="invariant"):
        mtp_jax.DecodeConfig(invariant=False, plan=execution_plan.xla_only("cpu", invariant=True))


def test_a_plan_for_several_devices_keeps_custom_calls_out():
    """A mesh of several CPU devices: XLA's partitioner does not split a custom call, so the plan names none."""
    mesh = jax.make_mesh((1,), ("data",))  # one device here; the resolution reads only the mesh's size
    plan = traced_plan.resolve(type("Rules", (), {"mesh": type("Mesh", (), {"devices": mesh.devices, "size": 2})})())
    assert plan.products is Products.XLA and plan.attention is DecodeAttention.XLA and not plan.one_device
