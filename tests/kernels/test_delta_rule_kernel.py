"""The gated DeltaNet's delta-rule kernel (kernels/delta_rule_kernel.py): in Pallas' interpreter here, against XLA's
scan (`recurrent_delta_rule`, itself checked against transformers' in tests/models/test_gated_deltanet.py); greedy
MTP decoding of a hybrid trunk through it equals plain decoding through it; and compiled through Mosaic for a TPU
topology, a hybrid trunk's MTP round calls it and holds no state per block position."""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.config import execution_plan
from mtp_jax.decode import speculative
from mtp_jax.kernels import delta_rule_kernel as kernel_module
from mtp_jax.kernels import dispatch, traced_plan
from mtp_jax.models.block_tree import BlockTree
from mtp_jax.models.gated_deltanet import recurrent_delta_rule, tree_delta_rule
from mtp_jax.parallel import sharding
from mtp_jax.plan import planning, shapes, topology
from tests.support.hybrid_models import predictable_hybrid_model
from tests.support.prompts import padded_prompts


def rule_inputs(seed: int, b: int, t: int, n: int, h: int, y: int):
    """q, k (unit rows; q scaled by H^-1/2), v, g <= 0, beta in (0, 1), a state: float32, as the layer gives them."""
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(b, t, n, h))) / np.sqrt(h)
    k = unit(rng.normal(size=(b, t, n, h)))
    v = rng.normal(size=(b, t, n, y))
    g = -rng.uniform(0.0, 1.0, size=(b, t, n))
    beta = rng.uniform(0.0, 1.0, size=(b, t, n))
    state = rng.normal(size=(b, n, h, y))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, state)]


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("tokens", [1, 4, 9])
@pytest.mark.parametrize("block_bytes", [kernel_module.STATE_BLOCK_BYTES, 16 * 128 * 4])  # heads at once, one a step
def test_kernel_matches_the_scan(tokens, block_bytes, monkeypatch):
    """Outputs and the state after the block; a replay without outputs over each row's own count of tokens (0: its
    state untouched, bit for bit; T: the block's last state); a block that writes no state."""
    monkeypatch.setattr(kernel_module, "STATE_BLOCK_BYTES", block_bytes)
    q, k, v, g, beta, state = rule_inputs(tokens, 3, tokens, 4, 16, 128)
    run = jax.jit(kernel_module.delta_rule_kernel, static_argnames=("final", "interpret"))
    out, final = run(q, k, v, g, beta, state, interpret=True)
    want_out, want_final = recurrent_delta_rule(q, k, v, g, beta, state)
    close(out, want_out)
    close(final, want_final)

    steps = jnp.array([0, tokens, (tokens + 1) // 2], jnp.int32)
    none, kept = run(None, k, v, g, beta, state, steps, interpret=True)
    assert none is None
    close(kept, recurrent_delta_rule(None, k, v, g, beta, state, steps)[1])
    np.testing.assert_array_equal(np.asarray(kept[0]), np.asarray(state[0]))
    close(kept[1], want_final[1])

    out_only, no_state = run(q, k, v, g, beta, state, final=False, interpret=True)
    assert no_state is None
    close(out_only, want_out)


@pytest.mark.parametrize("block_bytes", [kernel_module.STATE_BLOCK_BYTES, 16 * 128 * 4])
def test_a_tree_block_matches_the_replay_of_each_path(block_bytes, monkeypatch):
    """A draft tree's block (row 0 a branchy tree, row 1 a chain, row 2 the root's children only): each entry's
    output, its state continuing its parent's in VMEM, against XLA's replay of every entry's path from the root
    (`tree_delta_rule` without the kernel, itself checked against transformers); the chain's parents in place of
    the tree's give other outputs, so the comparison sees the parents."""
    monkeypatch.setattr(kernel_module, "STATE_BLOCK_BYTES", block_bytes)
    parents = jnp.array([[0, 0, 0, 1, 1, 2, 4, 3], [0, 0, 1, 2, 3, 4, 5, 6], [0] * 8], jnp.int32)
    tree = BlockTree.of(parents, 7)
    q, k, v, g, beta, state = rule_inputs(5, 3, 8, 4, 16, 128)
    run = jax.jit(kernel_module.delta_rule_kernel, static_argnames=("final", "interpret"))
    out, none = run(q, k, v, g, beta, state, final=False, interpret=True, parents=tree.parents)
    assert none is None
    want = tree_delta_rule(q, k, v, g, beta, state, tree)
    close(out, want)
    as_chain = run(q, k, v, g, beta, state, final=False, interpret=True, parents=parents[1:2].repeat(3, 0))[0]
    assert not np.allclose(np.asarray(as_chain[0]), np.asarray(want[0]), rtol=1e-3, atol=1e-4)


def test_a_kernel_that_drops_the_decay_fails_the_comparison():
    """The comparison above can fail: the kernel run with no decay (g = 0) against the scan with it is off."""
    q, k, v, g, beta, state = rule_inputs(0, 2, 4, 2, 16, 128)
    _, final = kernel_module.delta_rule_kernel(q, k, v, jnp.zeros_like(g), beta, state, interpret=True)
    with pytest.raises(AssertionError):
        close(final, recurrent_delta_rule(q, k, v, g, beta, state)[1])


def test_the_plan_takes_the_kernel_where_it_names_it():
    """On this CPU the resolved plan runs XLA's scan, a plan naming the kernel runs it (interpreted); a TPU's plan
    names it, and takes it for whole-lane head dims only."""
    _, k, _, _, _, state = rule_inputs(0, 1, 2, 2, 16, 128)
    here = traced_plan.resolve()
    assert here.delta_rule is execution_plan.DeltaRule.XLA_SCAN
    with traced_plan.tracing(here):
        assert dispatch.delta_rule_implementation(k, state) is None
    with traced_plan.tracing(dataclasses.replace(here, delta_rule=execution_plan.DeltaRule.PALLAS)):
        assert dispatch.delta_rule_implementation(k, state) is kernel_module.run
    tpu = _tpu_plan()
    assert tpu.delta_rule is execution_plan.DeltaRule.PALLAS
    with traced_plan.tracing(tpu):
        assert dispatch.delta_rule_implementation(k, state) is None  # H = 16: not whole lanes
        wide = jnp.zeros((1, 2, 128, 128))
        assert dispatch.delta_rule_implementation(jnp.zeros((1, 2, 2, 128)), wide) is kernel_module.run


def _tpu_plan() -> execution_plan.ExecutionPlan:
    """The plan resolved for a mesh of one TPU device (only its platform and size are read)."""
    mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="tpu")]), size=1)
    return traced_plan.resolve(types.SimpleNamespace(mesh=mesh))


@pytest.mark.slow
def test_greedy_mtp_through_the_kernel_equals_plain(monkeypatch):
    """A tiny hybrid trunk (gated DeltaNet + gated attention), batch 4 of mixed prompt lengths, EOS mid-batch:
    with every delta rule through the kernel (Pallas' interpreter, made available on this CPU), MTP decoding with 1
    and 3 drafts a round, and with a draft tree (each node's state continuing its parent's in the kernel), gives
    plain decoding's tokens through the kernel, which are XLA's."""
    model = predictable_hybrid_model(6)
    lens = np.array([1, 7, 4, 10], np.int32)
    prompts = padded_prompts(0, lens, 24)

    def decode(k: int, plan: execution_plan.ExecutionPlan, **settings):
        cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=48, plan=plan, **settings)
        out = mtp_jax.generate(model, prompts, lens, jax.random.key(0), cfg)
        return np.asarray(out.tokens), np.asarray(out.lengths)

    here = traced_plan.resolve()
    by_xla = decode(0, here)
    kernel_plan = dataclasses.replace(here, delta_rule=execution_plan.DeltaRule.PALLAS)
    ran = []
    run = kernel_module.delta_rule_kernel
    monkeypatch.setattr(kernel_module, "delta_rule_kernel", lambda *a, **kw: ran.append(1) or run(*a, **kw))
    plain = decode(0, kernel_plan)
    assert ran
    for k, settings in ((1, {}), (3, {}), (3, {"tree": 8, "tree_width": 3})):
        for got, want in zip(decode(k, kernel_plan, **settings), plain, strict=True):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(plain, by_xla, strict=True):
        np.testing.assert_array_equal(got, want)


def hybrid_round_hlo(head_dim: int, tree: int = 0) -> str:
    """The compiled MTP round (k = 3, batch 8; a draft tree of `tree` nodes) of qwen3.5-tiny with gated-DeltaNet
    head dims `head_dim`, for 4 TPU v5e chips (data=1, model=4)."""
    cfg = shapes.shape("qwen3.5-tiny")
    linear = dataclasses.replace(cfg.linear_attention, key_head_dim=head_dim, value_head_dim=head_dim)
    cfg = cfg.replace(linear_attention=linear)
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,model=4", topology.resolve("v5e:2x2").devices))
    work = planning.Workload(batch=8, prompt_len=16, max_new_tokens=32, num_draft=3, tree=tree, tree_width=3)
    model = planning.abstract_model(cfg, jnp.bfloat16, rules)
    state = planning.start_state(model, work, 3)
    return planning.round_program(model, work, 3, state, planning.compile_round(model, work, 3, state))


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_tpu_round_runs_the_kernel_and_keeps_no_state_per_position():
    """Compiled for a TPU topology with whole-lane head dims, the MTP round's delta rules are the kernel's custom
    calls (plain step, verify block and replay: Mosaic lowers it), and no buffer of the round has a state per block
    position ([..., T, N, H, Y] with T = 4); with head dims of 64 the round takes XLA's scan (no custom call)."""
    hlo = hybrid_round_hlo(128)
    loop = hlo[hlo.index(speculative.DECODE_LOOP) :]
    assert kernel_module.KERNEL_NAME in loop
    per_position = re.compile(r"f32\[(\d+,)*4,\d+,128,128\]")  # [..., T, N, H, Y]
    assert not per_position.search(hlo), per_position.search(hlo).group(0)
    assert kernel_module.KERNEL_NAME not in hybrid_round_hlo(64)


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_tpu_tree_round_keeps_its_nodes_states_in_the_kernel():
    """A draft tree's round (8 nodes) compiled for the TPU topology: its verify block's delta rules are the kernel's
    (each node's state continuing its parent's in VMEM), and no buffer holds a state per block entry, neither
    [..., 9, N, H, Y] nor the replay's [8 x 9 rows, N, H, Y]."""
    hlo = hybrid_round_hlo(128, tree=8)
    assert kernel_module.KERNEL_NAME in hlo[hlo.index(speculative.DECODE_LOOP) :]
    per_entry = re.compile(r"f32\[((\d+,)*9|72),\d+,128,128\]")
    assert not per_entry.search(hlo), per_entry.search(hlo).group(0)
