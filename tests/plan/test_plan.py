"""`python -m mtp_jax.plan` and what it reads off compiled programs: TPU topologies (libtpu's compiler, no TPU),
meshes laid out over their torus, collectives counted per execution, memory per chip against independent counts,
round costs extrapolated over layers, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mtp_jax.config import execution_plan
from mtp_jax.config.model import MoeConfig
from mtp_jax.decode import speculative
from mtp_jax.kernels import grouped_kernel, traced_plan
from mtp_jax.models import causal_lm
from mtp_jax.models import moe as moe_module
from mtp_jax.models.cache_attention import LayerSlots
from mtp_jax.parallel import sharding
from mtp_jax.plan import hlo_text, hlo_traffic, planning, routed_floor, shapes, topology
from mtp_jax.plan.hlo_collectives import array_bytes, collectives
from mtp_jax.runtime.errors import UserError
from tests.support.commands import ROOT, plan_in_process, run_plan


@pytest.fixture(scope="module", autouse=True)
def optimized():
    """Plans judge the program as it runs: XLA's optimizations on (the suite turns most off)."""
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


def test_array_bytes_of_types_and_tuples():
    assert array_bytes("bf16[2,3]{1,0}") == 12
    assert array_bytes("(f32[4], s8[10], pred[])") == 16 + 10 + 1
    assert array_bytes("f8e4m3fn[128,128]") == 128 * 128


HLO = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %v = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %r = f32[8,16]{1,0} all-reduce(%v), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], f32[8,16]) tuple(%i, %r)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%outer_body (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]) parameter(0)
  %w = (s32[], f32[8,16]) while(%q), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %g = f32[2,16]{1,0} get-tuple-element(%w), index=1
  %ag = f32[8,16]{1,0} all-gather(%g), dimensions={0}
  ROOT %u = (s32[], f32[8,16]) tuple(%i, %ag)
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %z = (s32[], f32[8,16]) tuple(%i, %a)
  %w2 = (s32[], f32[8,16]) while(%z), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %o = f32[8,16]{1,0} get-tuple-element(%w2), index=1
}
"""


def test_collectives_counted_per_execution_through_nested_loops():
    found = {c.kind: c for c in collectives(HLO)}
    assert found["all-reduce"].count == 15  # 5 inner trips x 3 outer trips
    assert found["all-gather"].count == 3
    assert found["all-reduce"].result_bytes == 8 * 16 * 4
    assert found["all-gather"].result_bytes == 8 * 16 * 4


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_collectives_of_a_tpu_program_match_its_loops():
    """A psum of the loop's own carry inside a fori_loop of 7 trips inside a scan of 3, compiled for 4 TPU v5e
    chips: 21 all-reduces of the [8, 128] float32 carry, however XLA keeps or unrolls the loops."""
    target = topology.resolve("v5e:2x2")
    mesh = jax.sharding.Mesh(list(target.devices), ("model",))
    split = NamedSharding(mesh, PartitionSpec(None, "model"))
    w = jax.ShapeDtypeStruct((3, 512), jnp.float32, sharding=split)
    x = jax.ShapeDtypeStruct((8, 512), jnp.float32, sharding=split)

    def local(w, x):  # w [3, 128], x [8, 128]: this chip's columns
        def layer(h, wl):
            step = lambda _, acc: jnp.tanh(jax.lax.psum(acc * wl, "model"))
            return jax.lax.fori_loop(0, 7, step, h), None

        return jax.lax.scan(layer, x, w)[0]

    specs = PartitionSpec(None, "model")
    program = jax.shard_map(local, mesh=mesh, in_specs=(specs, specs), out_specs=specs, check_vma=False)
    hlo = jax.jit(program).lower(w, x).compile().as_text()
    reductions = [c for c in collectives(hlo) if c.kind == "all-reduce"]
    assert sum(c.count for c in reductions) == 21
    assert {c.result_bytes for c in reductions} == {8 * 128 * 4}


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_topologies_resolve_with_their_chip_figures():
    v5e = topology.resolve("v5e:2x4")
    assert (len(v5e.devices), v5e.num_chips, v5e.capacity_bytes) == (8, 8, 16 * 1024**3)
    colab = topology.resolve("v5e:1x1")  # a one-chip host: libtpu needs its bounds
    assert len(colab.devices) == 1
    assert topology.resolve("v5p:2x2x2").chip.hbm_gib == 95
    assert topology.resolve("v5e:2x2", capacity_gib=2).capacity_bytes == 2 * 1024**3
    for bad in ("v9:2x2", "v5e", "v5e:two", "cpu:x", "cpu:64"):
        with pytest.raises(UserError) as e:
            topology.resolve(bad)
        assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_program_planned_again_is_compiled_once_for_the_same_mesh():
    """`planning.compiled`: a program lowered again for the same mesh is compiled once, its first compile's seconds
    reported; the same program text over another mesh of the same devices, or under other compiler settings, is
    compiled again (a program's output shardings name its own mesh)."""
    devices = topology.resolve("v5e:2x2").devices
    assert topology.resolve("v5e:2x2").devices is devices  # one description a process: programs take its devices

    def lowered(mesh):
        spec = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
        return jax.jit(lambda x: jnp.sin(x) * 2, in_shardings=spec, out_shardings=spec).lower(
            jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=spec)
        )

    square = sharding.make_mesh("data=2,model=2", devices)
    line = sharding.make_mesh("data=1,model=4", devices)
    first, seconds = planning.compiled(square, lowered(square))
    assert planning.compiled(square, lowered(square)) == (first, seconds)
    assert planning.compiled(line, lowered(line))[0] is not first
    optimizations = jax.config.values["jax_disable_most_optimizations"]
    try:
        jax.config.update("jax_disable_most_optimizations", not optimizations)
        assert planning.compiled(square, lowered(square))[0] is not first
    finally:
        jax.config.update("jax_disable_most_optimizations", optimizations)


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_meshes_split_physical_axes_of_the_torus():
    devices = topology.resolve("v5p:4x4x4").devices
    mesh = sharding.make_mesh("data=1,model=8,expert=8", devices)  # 8 is no product of the 4x4x4 torus's axes
    assert dict(mesh.shape) == {"data": 1, "expert": 8, "model": 8}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def tiny_dense():
    return shapes.SHAPES["tiny"]()


def test_with_segment_repeats_keeps_each_segments_kinds():
    deepseek = shapes.SHAPES["deepseek-v3-tiny"]()  # 1 dense layer, then MoE layers
    cut = planning.with_segment_repeats(deepseek, (1, 3))
    assert [(s.kind.mlp, s.count) for s in cut.segments()] == [("dense", 1), ("moe", 3)]
    hybrid = shapes.SHAPES["qwen3.5-tiny"]()  # 2 groups of (3 DeltaNet, 1 gated attention)
    cut = planning.with_segment_repeats(hybrid, (3,))
    assert cut.num_layers == 12 and cut.segments()[0].count == 3


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_round_cost_extrapolated_over_layers_equals_the_whole_trunk_unrolled():
    """Cut to 2 and 3 layers and extrapolated to 5, a round's flops equal those of the 5-layer trunk compiled
    unrolled in one piece; its HBM bytes are those of one iteration of generate's decode loop, loop bodies inside
    it per iteration."""
    cfg = tiny_dense().replace(num_layers=5)
    target = topology.resolve("v5e:2x2")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,model=4", target.devices))
    work = planning.Workload(batch=4, prompt_len=16, max_new_tokens=32, num_draft=2)
    model = planning.abstract_model(cfg, jnp.bfloat16, rules)
    state = planning.start_state(model, work, 2)
    hlo = planning.round_program(model, work, 2, state)
    projected = planning.round_cost(cfg, jnp.bfloat16, rules, work, 2, state, hlo)
    whole = planning.compile_round(model, work, 2, state, unroll=True)
    assert projected.flops == pytest.approx(whole.cost_analysis()["flops"], rel=0.02)
    assert projected.hbm_bytes == hlo_traffic.hbm_bytes(hlo, speculative.DECODE_LOOP)
    assert 0 < projected.hbm_bytes < hlo_traffic.hbm_bytes(hlo)  # the prefill and the loop's preparation are not


def independent_values_per_chip(cfg, model_shards: int) -> dict[str, int]:
    """The dense tiny model's values on data=1,model=M, counted from its config: vocabulary, query heads, MLP width
    split M ways; kv heads split only when M divides them; norms whole. A layer, the embedding, the lm_head, the
    trunk's final norm, and the MTP block without embedding or head (norms, [2D, D] projection, layer, final norm)."""
    d, v, f, n, k, h = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim)  # fmt: skip
    kv = 2 * d * k * h // (model_shards if k % model_shards == 0 else 1)
    layer = d * n * h // model_shards + kv + n * h * d // model_shards + 3 * d * f // model_shards + 2 * d
    embed = v * d // model_shards
    head = 0 if cfg.tie_word_embeddings else d * v // model_shards
    return {"layer": layer, "embed": embed, "head": head, "final_norm": d, "mtp": 2 * d + 2 * d * d + layer + d}


def independent_param_bytes_per_chip(cfg, model_shards: int) -> int:
    values = independent_values_per_chip(cfg, model_shards)
    trunk = values["embed"] + values["head"] + cfg.num_layers * values["layer"] + values["final_norm"]
    return 2 * (trunk + values["mtp"])  # bfloat16


@pytest.mark.parametrize("own", [False, True], ids=["lm_head", "own_embedding_and_head"])
@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_a_dense_rounds_floor_counts_what_each_pass_reads(draft_vocab, own):
    """An MTP round's floor, counted from the config: the verify reads the trunk's layers, final norm and lm_head
    (an untied embedding only gathers rows) and the cache; each of the k draft passes the MTP block and the head it
    drafts through (the MTP layer's own where it has one, else the lm_head), only the draft vocabulary's rows of it.
    The MTP layer's own embedding, like the trunk's, is only gathered."""
    base = tiny_dense()
    cfg = base.replace(mtp=dataclasses.replace(base.mtp, draft_vocab_size=draft_vocab, own_embedding=own,
                                               own_head=own))  # fmt: skip
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,model=1", jax.devices()[:1]))
    model = planning.abstract_model(cfg, jnp.bfloat16, rules)
    assert (model.mtp.head is not None, model.mtp.embed is not None) == (own, own)
    values, cache, drafts = independent_values_per_chip(cfg, 1), 12_345, 2
    verify = values["head"] + cfg.num_layers * values["layer"] + values["final_norm"]
    draft_pass = values["mtp"] + cfg.hidden_size * (draft_vocab or cfg.vocab_size)
    want = 2 * (verify + drafts * draft_pass) + cache
    assert routed_floor.routed_floor_bytes(model, cache, batch=1, num_draft=drafts) == want
    assert routed_floor.routed_floor_bytes(model, cache, batch=1, num_draft=0) == 2 * verify + cache


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_memory_report_counts_parameters_as_laid_out():
    cfg = tiny_dense()
    target = topology.resolve("v5e:2x2")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,model=4", target.devices))
    work = planning.Workload(batch=4, prompt_len=16, max_new_tokens=32, num_draft=2)
    model = planning.abstract_model(cfg, jnp.bfloat16, rules)
    report = planning.memory_report(model, work, target, planning.start_state(model, work, 2))
    assert report["params"] == independent_param_bytes_per_chip(cfg, 4)
    # XLA's own count of the program's arguments (parameters and prompts) pads tiny arrays to TPU tiles: at least
    # the parameters, at most the tile padding of [64]-sized norms and biases more.
    arguments = report["program"].memory_analysis().argument_size_in_bytes
    assert report["params"] <= arguments <= 2 * report["params"]
    assert report["fits"] and report["total"] <= report["capacity"]


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_plan_cli_writes_the_contract_fields(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_plan("--random-shape", "tiny", "--topology", "v5e:2x2", "--mesh", "data=2,model=2",
                    "--max-new-tokens", "32", "--prompt-len", "16", "--json", str(out), "--dump-hlo",
                    str(tmp_path / "hlo"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    for field in ("topology", "chip", "num_chips", "mesh", "model", "params", "batch_size", "prompt_len",
                  "max_new_tokens", "num_draft", "weights", "compile_seconds", "fits", "per_chip_bytes",
                  "round_collectives", "plain_step", "mtp_round", "projected_tokens_per_second"):  # fmt: skip
        assert field in plan
    assert plan["mesh"] == {"data": 2, "expert": 1, "model": 2}
    assert set(plan["per_chip_bytes"]) >= {"params", "caches", "temporaries", "total", "capacity"}
    assert plan["plain_step"]["hbm_bytes"] > 0 and plan["mtp_round"]["flops"] > plan["plain_step"]["flops"]
    plain = plan["plain_step"]
    assert plain["hbm_over_floor"] == pytest.approx(plain["hbm_bytes"] / plain["floor_bytes"])
    per_round = 1 + 0.8 + 0.8**2 + 0.8**3  # the assumed acceptance at k = 3
    tps = plan["projected_tokens_per_second"]
    assert tps["mtp"] == pytest.approx(1000 * 8 * per_round / plan["mtp_round"]["projected_ms"])
    assert {p.name for p in (tmp_path / "hlo").iterdir()} == {"plain_step.hlo.txt", "mtp_round.hlo.txt"}
    assert "| tiny | v5e:2x2 |" in proc.stdout
    memory = plan["per_chip_bytes"]  # said on stderr before the cost compiles, as the table says it
    said = f"total {memory['total'] / 2**30:.2f} / {memory['capacity'] / 2**30:.2f} GiB: fits"
    assert f"memory per device: params {memory['params'] / 2**30:.2f}," in proc.stderr and said in proc.stderr


TREE_PLAN = ["--topology", "v5e:2x2", "--mesh", "data=1,model=4", "--max-new-tokens", "32", "--prompt-len", "16",
             "--num-draft", "2", "--tree", "6", "--tree-width", "2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.parametrize("shape", ["tiny", "qwen3.5-tiny"])
def test_plan_of_a_draft_tree_round(tmp_path, shape):
    """--tree N: the round compiled is a tree's, its verify block N + 1 rows of the trunk (more flops than N + 1
    plain steps; a chain of the same depth verifies 3 rows: compiled beside it for the dense trunk), its projection
    from --tokens-per-round when given; a hybrid trunk's too (its DeltaNet layers through the delta-rule kernel, a
    row per node)."""
    plans = {"tree": ["--random-shape", shape, *TREE_PLAN, "--tokens-per-round", "2.5"]}
    if shape == "tiny":
        plans["chain"] = plans["tree"][: plans["tree"].index("--tree")]
    for name, argv in plans.items():
        proc = plan_in_process(*argv, "--json", str(tmp_path / f"{name}.json"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans[name] = json.loads((tmp_path / f"{name}.json").read_text())
    tree = plans["tree"]
    assert (tree["tree"], tree["tree_width"], tree["num_draft"]) == (6, 2, 2)
    assert tree["mtp_round"]["flops"] > 7 * tree["plain_step"]["flops"]
    if shape == "tiny":
        chain = plans["chain"]
        assert chain["tree"] == 0 and tree["plain_step"]["flops"] == chain["plain_step"]["flops"]
        assert 3 * chain["plain_step"]["flops"] < chain["mtp_round"]["flops"] < 7 * chain["plain_step"]["flops"]
    assert tree["tokens_per_round"] == 2.5 and tree["acceptance_source"] == "--tokens-per-round"
    tps = tree["projected_tokens_per_second"]["mtp"]
    assert tps == pytest.approx(1000 * 8 * 2.5 / tree["mtp_round"]["projected_ms"])


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_draft_vocabulary_shrinks_a_tree_rounds_reads(tmp_path):
    """--draft-vocab N: the MTP passes draft from N token ids (the rows of the lm_head they read), so a tree round
    reads less than with the whole vocabulary, and the plain step is the same program. (The whole vocabulary's plan
    is the tree test's, compiled once in this process.)"""
    plans = {}
    for name, extra in (("whole", []), ("subset", ["--draft-vocab", "64"])):
        proc = plan_in_process("--random-shape", "tiny", *TREE_PLAN, *extra, "--json", str(tmp_path / f"{name}.json"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans[name] = json.loads((tmp_path / f"{name}.json").read_text())
    whole, subset = plans["whole"], plans["subset"]
    assert (whole["draft_vocab"], subset["draft_vocab"]) == (0, 64)
    assert subset["mtp_round"]["hbm_bytes"] < whole["mtp_round"]["hbm_bytes"]
    assert subset["plain_step"]["hbm_bytes"] == whole["plain_step"]["hbm_bytes"]
    cfg = tiny_dense()  # its floor: the two draft passes read 64 of the lm_head's rows, split 4 ways
    fewer_rows = 2 * 2 * cfg.hidden_size * (cfg.vocab_size - 64) // 4
    assert whole["mtp_round"]["routed_floor_bytes"] - subset["mtp_round"]["routed_floor_bytes"] == fewer_rows
    assert subset["mtp_round"]["hbm_over_routed_floor"] >= 1


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology", "v5e:2x2", "--tree", "2"], "holds at least 3 nodes"),
        (["--topology", "v5e:2x2", "--draft-vocab", "100000000"], "more than"),
        (["--topology", "v7x:2x2"], "bad topology"),
        (["--topology", "gpu:8"], "JAX sees no GPU here"),  # gpu:N describes GPUs like an attached one
        (["--topology", "v5p:2x2x1", "--mesh", "data=3,model=1", "--max-new-tokens", "32"], "lay out here"),
        (["--topology", "v5e:2x2", "--max-new-tokens", "100000"], "context"),
        (["--topology", "v5e:2x2", "--weights", "fp4"], "invalid choice"),
        (["--topology", "v5e:2x2", "--random-shape", "gpt-5"], "unknown shape"),
        (["--topology", "v5e:2x2", "--json", ROOT], "is a folder"),
    ],
)
def test_plan_cli_bad_input_is_one_line(args, message):
    proc = plan_in_process("--random-shape", "tiny", *args)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_auto_mesh_lists_every_layout_best_first(tmp_path):
    out = tmp_path / "plans.json"
    proc = plan_in_process("--random-shape", "tiny", "--topology", "v5e:2x2", "--mesh", "auto", "--batch-size", "2",
                    "--max-new-tokens", "32", "--prompt-len", "16", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = json.loads(out.read_text())
    assert sorted(tuple(p["mesh"].values()) for p in plans) == [(1, 1, 4), (2, 1, 2)]  # data divides the batch
    speeds = [p["projected_tokens_per_second"]["mtp"] for p in plans]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_tokens_per_round_and_projection_arithmetic():
    assert planning.tokens_per_round([0.5, 0.25], 3) == pytest.approx(1 + 0.5 + 0.125 + 0.03125)
    chip = topology.Chip("x", 1, hbm_gbps=1000, bf16_tflops=100, ici_gbps=100)
    target = dataclasses.replace(topology.resolve("v5e:2x2"), chip=chip)
    cost = planning.RoundCost(hbm_bytes=1e9, flops=1e9, ici_bytes=1e8)
    assert planning.projected_ms(cost, target) == pytest.approx(1000 * (1e9 / 1e12 + 1e8 / 1e11))
    compute_bound = dataclasses.replace(cost, flops=1e12)
    assert math.isclose(planning.projected_ms(compute_bound, target), 1000 * (1e12 / 1e14 + 1e-3))


def wide_moe(family: str):
    """A DeepSeek-V3 (sigmoid routing, MLA) or Qwen3.5-MoE (softmax routing, hybrid) shape wide enough that an
    expert tensor dwarfs a round's activations: 32 experts of width 256 over hidden 512."""
    if family == "deepseek":
        cfg = shapes.shape("deepseek-v3-tiny")
        moe = dataclasses.replace(cfg.moe, num_experts=32, expert_intermediate_size=256, num_groups=4, topk_groups=2)
        return cfg.replace(hidden_size=512, intermediate_size=1024, moe=moe)
    cfg = shapes.shape("qwen3.5-tiny")
    moe = MoeConfig(num_experts=32, experts_per_token=4, expert_intermediate_size=256, scoring="softmax",
                    shared_intermediate_size=256)  # fmt: skip
    return cfg.replace(hidden_size=512, intermediate_size=1024, moe=moe)


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.parametrize("family", ["deepseek"])  # softmax routing: the same expert path (parallel/test_sharding.py)
def test_moe_round_moves_activations_not_expert_weights(family, monkeypatch):
    """Compiled for 4 TPU v5p chips with the experts split 4 ways, no collective of an MTP round moves more than 1%
    of a chip's parameter bytes, whether its passes run every expert (small passes, the default here) or grouped
    matmuls (forced). Left to XLA's partitioner (the single-device grouped path, forced here), the same round
    all-gathers whole expert tensors every layer: the check catches it."""
    target = topology.resolve("v5p:2x2x1")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,expert=4,model=1", target.devices))
    work = planning.Workload(batch=8, prompt_len=16, max_new_tokens=32, num_draft=3)
    model = planning.abstract_model(wide_moe(family), jnp.bfloat16, rules)
    params = planning.shard_bytes(nnx.split(model)[1])
    state = planning.start_state(model, work, 3)

    def largest_moved():
        loop = planning.compile_round(model, work, 3, state)  # the decode loop alone: no prefill to compile
        found = collectives(planning.round_program(model, work, 3, state, loop), speculative.DECODE_LOOP)
        return max(max(c.operand_bytes, c.result_bytes) for c in found)

    assert largest_moved() < planning.PARAM_SIZED * params
    monkeypatch.setattr(moe_module, "DENSE_EXPERT_ROWS", 0)
    jax.clear_caches()
    assert largest_moved() < planning.PARAM_SIZED * params
    monkeypatch.setattr(moe_module, "_expert_parallel", lambda *args: None)
    jax.clear_caches()
    expert_tensor = 32 * 512 * 256 * 2  # one layer's [E, D, F] in bfloat16
    assert largest_moved() >= expert_tensor


def materialized(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Instructions of a compiled program's decode loop that write a buffer of one of these array shapes (a leading
    axis of size 1 ignored): those outside fused computations, other than parameters and tuple plumbing."""
    bodies, runs = hlo_text.loop_runs(hlo, speculative.DECODE_LOOP)
    tables = {name: hlo_text.instructions(lines) for name, lines in bodies.items()}
    fusions = [rest for table in tables.values() for _, op, rest in table.values() if op == "fusion"]
    fused = {callee for rest in fusions for callee in re.findall(r"calls=%?([\w.\-]+)", rest)}
    plumbing = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional", "copy-done"}
    found = []
    for name, table in tables.items():
        for instruction, (result, op, _) in table.items():
            dims = [tuple(int(d) for d in filter(None, m.split(","))) for m in re.findall(r"\[([0-9,]*)\]", result)]
            written = any((d[1:] if d[:1] == (1,) else d) in shapes for d in dims)
            if runs[name] and name not in fused and op not in plumbing and written:
                found.append(f"{op} {instruction}: {result[:80]}")
    return found


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_small_moe_passes_read_stacked_expert_weights_in_place(monkeypatch):
    """With stacked layers, a plain step that runs every expert (a small pass) reads each routed-expert weight where
    it lies in the [L, E, ...] stack: no instruction writes a layer's expert weight anywhere. Forced to grouped
    matmuls, whose operand is first copied out of the stack, the same step does: the check catches it."""
    target = topology.resolve("v5p:2x2x1")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,expert=4,model=1", target.devices))
    work = planning.Workload(batch=8, prompt_len=16, max_new_tokens=32, num_draft=3)
    cfg = wide_moe("deepseek")
    model = planning.abstract_model(cfg, jnp.bfloat16, rules, layout="stacked")
    local, d, f = cfg.moe.num_experts // 4, cfg.hidden_size, cfg.moe.expert_intermediate_size
    state = planning.start_state(model, work, 0)

    def expert_copies():
        hlo = planning.round_program(model, work, 0, state, planning.compile_round(model, work, 0, state))
        return materialized(hlo, {(local, d, f), (local, f, d)})

    assert expert_copies() == []
    monkeypatch.setattr(moe_module, "DENSE_EXPERT_ROWS", 0)
    xla_grouped = execution_plan.LargePassExperts.RAGGED_DOT
    work = dataclasses.replace(work, plan=dataclasses.replace(traced_plan.resolve(rules), large_experts=xla_grouped))
    assert expert_copies()


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_large_moe_passes_run_the_grouped_kernel_over_the_whole_stacks(monkeypatch):
    """Compiled for TPU (Mosaic), an MTP round whose passes are past DENSE_EXPERT_ROWS (lowered to 4 here: the
    batch of 8 and its 32-row verify block are large passes) runs each MoE layer's experts as one grouped-kernel
    call over the whole stacks: no instruction writes a layer's expert weight anywhere (no copy of a stack), and
    the round's traffic counts (hlo_traffic) grow by an expert's bytes per fetched expert and call: once per MoE
    layer of the verify and per MTP pass. The experts are 4096 wide here: at 256, XLA prefetched the MTP layer's
    (2 MiB a chip) into on-chip memory whole."""
    monkeypatch.setattr(moe_module, "DENSE_EXPERT_ROWS", 4)
    target = topology.resolve("v5p:2x2x1")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,expert=4,model=1", target.devices))
    work = planning.Workload(batch=8, prompt_len=16, max_new_tokens=32, num_draft=3)
    cfg = wide_moe("deepseek")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, expert_intermediate_size=4096))
    model = planning.abstract_model(cfg, jnp.bfloat16, rules, layout="stacked")
    local, d, f = cfg.moe.num_experts // 4, cfg.hidden_size, cfg.moe.expert_intermediate_size
    state = planning.start_state(model, work, 3)
    hlo = planning.round_program(model, work, 3, state, planning.compile_round(model, work, 3, state))
    bodies, runs = hlo_text.loop_runs(hlo, speculative.DECODE_LOOP)
    calls = [
        line for name, lines in bodies.items() if runs[name] for line in lines if grouped_kernel.KERNEL_NAME in line
    ]
    assert calls, "the round runs no grouped-experts kernel"
    assert materialized(hlo, {(local, d, f), (local, f, d)}) == []
    expert = 3 * d * f * 2  # gate, up, down of one expert, bfloat16
    fetched = lambda n: hlo_traffic.hbm_bytes(hlo, speculative.DECODE_LOOP, lambda rows, local, slots: n)
    per_expert = fetched(2) - fetched(1)
    assert per_expert > 0 and fetched(4) - fetched(2) == pytest.approx(2 * per_expert, rel=1e-6)
    calls = per_expert / expert
    assert calls == pytest.approx(cfg.num_layers - cfg.moe.first_dense_layers + 3, abs=1e-6)  # + 3 MTP passes


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_plain_step_reads_only_the_routed_experts_through_the_kernel():
    """Compiled for TPU (Mosaic), a plain step at batch 1 runs each MoE layer's experts as one routed-experts kernel
    call over the whole stacks: its traffic counts (hlo_traffic) grow by an expert's bytes per fetched expert and
    layer, and nothing else in the step depends on how many are fetched (no copy of an expert stack)."""
    target = topology.resolve("v5p:2x2x1")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,expert=4,model=1", target.devices))
    work = planning.Workload(batch=1, prompt_len=16, max_new_tokens=32, num_draft=0)
    cfg = wide_moe("deepseek")
    model = planning.abstract_model(cfg, jnp.bfloat16, rules, layout="stacked")
    state = planning.start_state(model, work, 0)
    hlo = planning.round_program(model, work, 0, state, planning.compile_round(model, work, 0, state))
    bodies, runs = hlo_text.loop_runs(hlo, speculative.DECODE_LOOP)
    calls = [line for name, lines in bodies.items() if runs[name] for line in lines if "mtp_jax_routed_experts" in line]
    assert calls, "the plain step runs no routed-experts kernel"
    layers = cfg.num_layers - cfg.moe.first_dense_layers
    expert = 3 * cfg.hidden_size * cfg.moe.expert_intermediate_size * 2  # gate, up, down of one expert, bfloat16
    fetched = lambda n: hlo_traffic.hbm_bytes(hlo, speculative.DECODE_LOOP, lambda rows, local, slots: n)
    assert fetched(3) - fetched(1) == pytest.approx(2 * layers * expert, rel=1e-6)
    every_slot = hlo_traffic.hbm_bytes(hlo, speculative.DECODE_LOOP)  # no routing model: every slot (4 picks)
    assert every_slot == pytest.approx(fetched(4), rel=1e-6)


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_unstacked_layers_never_copy_the_whole_latent_cache_stack(monkeypatch):
    """DeepSeek-V3's latent attention (128 heads, latent 512) over 4 unstacked MoE layers, its cache split over its
    slots on the 32 chips of v5p:4x4x2 (data=1,expert=8,model=4; 4096 new tokens): no instruction of a plain step
    copies the whole [4, B, S, 576] stack of the segment's latent cache. Reading each layer's entries in place from
    the stack (LayerSlots, as a layer scan does), XLA copied the whole stack into attention's layout once per layer,
    and a step's cache bytes grew with the square of the layers (the full model's fp8 plain step: 41.3 GiB, against
    26 read layer by layer; docs/benchmarks-log.md, "fp8 on TPU at full depth"): the check catches it, once the
    barrier that keeps attention's layout off the stack (models/mla.py) is taken away too."""
    full = shapes.full_shape("deepseek-v3")
    moe = dataclasses.replace(full.moe, num_experts=8, expert_intermediate_size=256, num_groups=1, topk_groups=1,
                              experts_per_token=2, first_dense_layers=1)  # fmt: skip
    cfg = full.replace(hidden_size=1024, intermediate_size=512, vocab_size=4096, moe=moe)
    cfg = planning.with_segment_repeats(cfg, (1, 4))
    target = topology.resolve("v5p:4x4x2")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,expert=8,model=4", target.devices))
    work = planning.Workload(batch=8, prompt_len=16, max_new_tokens=4096, num_draft=0)
    model = planning.abstract_model(cfg, jnp.bfloat16, rules, "bfloat16", "unstacked")
    state = planning.start_state(model, work, 0)
    stack = next(leaf for leaf in jax.tree.leaves(state.cache) if leaf.shape[0] == 4)  # [4, B, S, C], S split
    local = stack.sharding.shard_shape(stack.shape)

    def whole_stack_copies():  # (the step's own entries are written into the stack in place: not a copy)
        hlo = planning.round_program(model, work, 0, state, planning.compile_round(model, work, 0, state))
        return [found for found in materialized(hlo, {local}) if found.startswith("copy")]

    assert whole_stack_copies() == []
    monkeypatch.setattr(causal_lm, "layer_entries", lambda stacked, layer: LayerSlots(stacked, layer))
    monkeypatch.setattr(jax.lax, "optimization_barrier", lambda x: x)  # mla.py's, before the chunk read
    jax.clear_caches()
    assert whole_stack_copies()


def test_meshes_the_compiler_refuses_for_memory_are_skipped(monkeypatch, capsys):
    """--mesh auto: a mesh whose programs the compiler refuses for the chip's memory is named on stderr and skipped;
    when none is left, one line and exit status 1. Another compiler error is not taken for it."""
    from mtp_jax.cli import plan as plan_cli

    def refuse(*_):
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required (9G) exceeds 8G.")

    monkeypatch.setattr(plan_cli, "plan_mesh", refuse)
    argv = ["--random-shape", "tiny", "--topology", "cpu:1", "--capacity-gib", "1", "--max-new-tokens", "32"]
    assert plan_cli.run_cli(plan_cli.run, plan_cli.build_parser().parse_args(argv)) == 1
    err = capsys.readouterr().err
    assert "mesh data=1,expert=1,model=1: does not fit: RESOURCE_EXHAUSTED: Ran out of memory" in err
    assert "error: tiny does not fit cpu:1 on any mesh tried" in err and "Traceback" not in err

    def fail(*_):
        raise RuntimeError("INTERNAL: something else")

    monkeypatch.setattr(plan_cli, "plan_mesh", fail)
    with pytest.raises(RuntimeError, match="something else"):
        plan_cli.run(plan_cli.build_parser().parse_args(argv))
