"""A pass's routed experts read only the experts it uses: for a small pass the Pallas kernel of kernels/routed_kernel.py
and XLA's gathered form, for a large one the grouped kernel of kernels/grouped_kernel.py (both kernels in Pallas'
interpreter here; tests/plan/test_plan.py compiles them through Mosaic for a TPU topology), against a float64
reference of each row through its own experts; greedy decoding through the kernels against every expert on every
row; the routed floor's expectation against exact enumeration."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.config import execution_plan
from mtp_jax.families.registry import model_config_from_hf, tiny_configs
from mtp_jax.kernels import dispatch, grouped_kernel, routed_kernel, traced_plan
from mtp_jax.models import moe as moe_module
from mtp_jax.plan import routed_floor
from mtp_jax.quant import fp8, int8, loop_weights, quantized_array
from tests.support.prompts import padded_prompts

L, E, D, F = 3, 8, 128, 256


def _stacks(rng, dtype=jnp.float32):
    """gate, up [L, E, D, F] and down [L, E, F, D] with random values."""
    w = lambda *shape: jnp.asarray(rng.normal(size=shape) / 10, dtype)
    return w(L, E, D, F), w(L, E, D, F), w(L, E, F, D)


def _every_expert(x, weights, ids, layer, stacks):
    """The reference, in float64 numpy: each row's picks of this shard's experts (ids in [0, E)) through their own
    expert of layer `layer` of the (dequantized) stacks, weighted and summed."""
    gate, up, down = (np.asarray(quantized_array.dense(s)[layer], np.float64) for s in stacks)
    x, weights, ids = np.asarray(x, np.float64), np.asarray(weights, np.float64), np.asarray(ids)
    out = np.zeros((x.shape[0], down.shape[-1]))
    for m, o in np.ndindex(ids.shape):
        e = ids[m, o]
        if 0 <= e < gate.shape[0]:
            g, u = x[m] @ gate[e], x[m] @ up[e]
            out[m] += weights[m, o] * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


ROUTINGS = {  # local ids [M, O] (out of [0, E): another shard's expert)
    "one row": [[3, 6]],
    "rows share experts, most unused": [[1, 5], [5, 2], [1, 2], [7, 1], [2, 5]],
    "all rows on one expert": [[4, -1], [4, 9], [4, 12]],
    "every expert used": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "no expert of this shard": [[-3, 8], [11, 9]],
}


@pytest.mark.slow
@pytest.mark.parametrize("routing", ROUTINGS, ids=list(ROUTINGS))
@pytest.mark.parametrize("form", ["kernel", "gathered"])
def test_routed_forms_match_every_expert(routing, form):
    rng = np.random.default_rng(len(routing))
    ids = jnp.asarray(ROUTINGS[routing], jnp.int32)
    x = jnp.asarray(rng.normal(size=(ids.shape[0], D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=ids.shape), jnp.float32)
    stacks = _stacks(rng)
    layer = jnp.int32(2)  # past the first: the kernel's fetch starts at the layer's experts
    if form == "kernel":
        out = routed_kernel.routed_experts_kernel(x, weights, ids, layer, *stacks, interpret=True)
    else:
        out = routed_kernel.gathered_experts(x, weights, ids, layer, *stacks)
    want = _every_expert(x, weights, ids, 2, stacks)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    if routing == "no expert of this shard":
        assert not np.any(np.asarray(out))


def _quantized(rng, form: str):
    """int8 with a scale per output channel, or float8 in 128 x 128 blocks spread over the outputs (as the decode
    loop holds them: loop_weights.loop_weight)."""
    stacks = _stacks(rng)
    out = []
    for s, contracting in zip(stacks, (2, 2, 2), strict=True):
        if form == "int8":
            out.append(int8.quantize_int8(s, (contracting,)))
        else:
            w = fp8.quantize_fp8(s, (contracting,), batched=(0, 1))
            out.append(loop_weights.spread_output_scales(w, (*w.scales.shape[:-1], w.shape[-1])))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_the_kernel_reads_quantized_experts_as_stored(form):
    rng = np.random.default_rng(7)
    stacks = _quantized(rng, form)
    assert all(routed_kernel.supports(s) for s in stacks)
    ids = jnp.asarray(ROUTINGS["rows share experts, most unused"], jnp.int32)
    x = jnp.asarray(rng.normal(size=(ids.shape[0], D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=ids.shape), jnp.float32)
    out = routed_kernel.routed_experts_kernel(x, weights, ids, jnp.int32(1), *stacks, interpret=True)
    np.testing.assert_allclose(out, _every_expert(x, weights, ids, 1, stacks), rtol=2e-5, atol=2e-5)


def _large_routing(name: str, rng) -> np.ndarray:
    """Local ids [M, O] of a pass past one tile of sorted pairs (grouped_kernel.ROW_TILE)."""
    if name == "pairs over three tiles, every expert":
        return rng.integers(0, E, size=(150, 2))
    if name == "all pairs on one expert, across tiles":
        return np.full((140, 1), 5)
    if name == "other shards' picks among them":
        return rng.integers(-4, E + 4, size=(131, 3))
    return rng.integers(E, 2 * E, size=(129, 2))  # no expert of this shard


LARGE_ROUTINGS = ["pairs over three tiles, every expert", "all pairs on one expert, across tiles",
                  "other shards' picks among them", "no expert of this shard"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("routing", LARGE_ROUTINGS)
def test_the_grouped_kernel_matches_each_row_through_its_own_experts(routing):
    rng = np.random.default_rng(len(routing))
    ids = jnp.asarray(_large_routing(routing, rng), jnp.int32)
    x = jnp.asarray(rng.normal(size=(ids.shape[0], D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=ids.shape), jnp.float32)
    stacks = _stacks(rng)
    out = grouped_kernel.grouped_experts_kernel(x, weights, ids, jnp.int32(2), *stacks, interpret=True)
    np.testing.assert_allclose(out, _every_expert(x, weights, ids, 2, stacks), rtol=2e-5, atol=2e-5)
    if routing == "no expert of this shard":
        assert not np.any(np.asarray(out))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["int8", "fp8", "bfloat16"])
def test_the_grouped_kernel_reads_quantized_and_bfloat16_experts(form):
    """int8 and float8 stacks read as stored; bfloat16 rows and weights, whose float32 outputs the kernel carries
    back in two bfloat16 parts (within 2^-16 of each, against the reference of the same bfloat16 values)."""
    rng = np.random.default_rng(11)
    stacks = _stacks(rng, jnp.bfloat16) if form == "bfloat16" else _quantized(rng, form)
    ids = jnp.asarray(_large_routing("other shards' picks among them", rng), jnp.int32)
    dtype = jnp.bfloat16 if form == "bfloat16" else jnp.float32
    x = jnp.asarray(rng.normal(size=(ids.shape[0], D)), dtype)
    weights = jnp.asarray(rng.uniform(size=ids.shape), jnp.float32)
    out = grouped_kernel.grouped_experts_kernel(x, weights, ids, jnp.int32(1), *stacks, interpret=True)
    want = _every_expert(x, weights, ids, 1, stacks)
    tolerance = 3e-2 if form == "bfloat16" else 2e-5  # bfloat16: the hidden rounded to it before the down product
    np.testing.assert_allclose(out, want, rtol=tolerance, atol=tolerance)


def test_work_items_cover_each_experts_pairs_once():
    """Each used expert's items are the tiles its sorted pairs touch, in expert order, spare items repeating the
    last one; against a count in numpy."""
    rng = np.random.default_rng(5)
    for _ in range(10):
        rows, picks = int(rng.integers(1, 90)), int(rng.integers(1, 4))
        ids = rng.integers(-2, E + 2, size=(rows, picks))
        items = grouped_kernel.WorkItems(jnp.ones(ids.shape), jnp.asarray(ids, jnp.int32), E)
        flat = np.sort(np.where((ids >= 0) & (ids < E), ids, E).reshape(-1), kind="stable")
        want = [(e, t) for e in range(E) for t in sorted({i // grouped_kernel.ROW_TILE
                                                           for i in np.flatnonzero(flat == e)})]  # fmt: skip
        count = int(items.count)
        got = list(zip(np.asarray(items.expert).tolist(), np.asarray(items.tile).tolist(), strict=True))
        assert count == len(want) and got[:count] == want and count <= items.size
        assert set(got[count:]) <= {got[count - 1]} if count else True


def test_a_kernel_that_reads_the_wrong_layer_fails_the_comparison():
    """The comparison above can fail: layer 1's experts read where layer 2's were asked for."""
    rng = np.random.default_rng(3)
    ids = jnp.asarray(ROUTINGS["rows share experts, most unused"], jnp.int32)
    x = jnp.asarray(rng.normal(size=(ids.shape[0], D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=ids.shape), jnp.float32)
    stacks = _stacks(rng)
    out = routed_kernel.routed_experts_kernel(x, weights, ids, jnp.int32(1), *stacks, interpret=True)
    assert np.abs(np.asarray(out - _every_expert(x, weights, ids, 2, stacks))).max() > 1e-2


@pytest.mark.slow
def test_used_experts_lists_each_used_expert_once_then_repeats_the_last():
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows, picks = rng.integers(1, 6), rng.integers(1, 4)
        ids = rng.integers(-2, E + 2, size=(rows, picks))
        slots = routed_kernel.slots_for(rows, picks, E)
        used, count = routed_kernel.used_experts(jnp.asarray(ids, jnp.int32), E, slots)
        want = sorted({int(i) for i in ids.reshape(-1) if 0 <= i < E})
        assert int(count) == len(want) and list(np.asarray(used)[: len(want)]) == want
        if want:
            assert set(np.asarray(used)[len(want) :].tolist()) <= {want[-1]}  # the fetched block, not fetched again


def _enumerated(rows: int, picks: int, total: int, local: int) -> float:
    """Expected distinct experts among the first `local`: every rows-tuple of pick sets, counted."""
    sets = list(itertools.combinations(range(total), picks))
    used = sum(len({e for s in choice for e in s if e < local}) for choice in itertools.product(sets, repeat=rows))
    return used / len(sets) ** rows


@pytest.mark.parametrize("rows,picks,total,local", [(1, 2, 6, 3), (2, 2, 5, 5), (3, 1, 4, 2), (2, 3, 6, 2)])
def test_the_routed_floor_expectation_matches_enumeration(rows, picks, total, local):
    want = _enumerated(rows, picks, total, local)
    assert math.isclose(routed_floor.expected_experts(rows, picks, total, local), want, rel_tol=1e-12)


def test_the_cpu_plan_picks_the_routed_form_for_small_passes():
    """On a CPU: XLA's gathered form where copying the used experts costs less than reading them all (3 U < E),
    every expert elsewhere and under batch-invariant decoding (its fixed order); XLA's grouped matmuls for a large
    pass."""
    stacks = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, 64, D, F), (1, 64, D, F), (1, 64, F, D)))
    pick = lambda rows, invariant=False: _picked(rows, stacks, invariant)
    assert pick(1) is routed_kernel.gathered_experts  # 8 slots of 64 experts
    assert pick(2) is routed_kernel.gathered_experts
    assert pick(3) is None  # 24 slots: 72 >= 64
    assert pick(1, invariant=True) is None
    assert pick(moe_module.DENSE_EXPERT_ROWS + 1) is None  # a large pass: the grouped kernel is a TPU's


def _picked(rows, stacks, invariant):
    x = jax.ShapeDtypeStruct((rows, D), jnp.float32)
    ids = jax.ShapeDtypeStruct((rows, 8), jnp.int32)
    with traced_plan.tracing(traced_plan.resolve(invariant=invariant)):
        return dispatch.experts_implementation(x, ids, *stacks, manual=True, small=rows <= moe_module.DENSE_EXPERT_ROWS)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["pallas", "grouped"])
def test_greedy_decoding_through_the_kernel_is_every_experts(monkeypatch, kernel):
    """A tiny DeepSeek-V3 (16 experts, 4 picks), batch 4 of mixed prompt lengths: greedy decoding with the routed
    experts through a kernel (Pallas' interpreter, named by the plan on this CPU) gives the tokens of every expert on
    every row, plain and with 2 drafts a round. The grouped kernel takes passes past DENSE_EXPERT_ROWS, lowered to 2
    here so that every pass (prefill, steps, verify blocks) is one."""
    cfg = model_config_from_hf(tiny_configs()["deepseek_v3"]).replace(eos_token_ids=())
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(0))
    lens = np.array([3, 9, 1, 6], np.int32)
    prompts = padded_prompts(3, lens, cfg.vocab_size)

    def decode(k: int, plan):
        cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=12, plan=plan)
        return np.asarray(mtp_jax.generate(model, prompts, lens, jax.random.key(0), cfg).tokens)

    small, large = execution_plan.SmallPassExperts, execution_plan.LargePassExperts
    every_expert_plan = dataclasses.replace(
        traced_plan.resolve(), small_experts=small.EVERY_EXPERT, large_experts=large.RAGGED_DOT
    )
    every_expert = decode(0, every_expert_plan)
    module = routed_kernel if kernel == "pallas" else grouped_kernel
    run_name = "routed_experts_kernel" if kernel == "pallas" else "grouped_experts_kernel"
    if kernel == "pallas":
        plan = dataclasses.replace(every_expert_plan, small_experts=small.PALLAS)
    else:
        plan = dataclasses.replace(every_expert_plan, large_experts=large.PALLAS_GROUPED)
        monkeypatch.setattr(moe_module, "DENSE_EXPERT_ROWS", 2)
    ran = []
    run = getattr(module, run_name)
    monkeypatch.setattr(module, run_name, lambda *a, **k: ran.append(1) or run(*a, **k))
    np.testing.assert_array_equal(decode(0, plan), every_expert)
    np.testing.assert_array_equal(decode(2, plan), every_expert)
    assert ran  # the passes went through the kernel
