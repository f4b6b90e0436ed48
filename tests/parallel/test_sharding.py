"""Sharded decoding on a `jax.sharding` mesh: same greedy tokens as one device, shards of 1/M, no weight all-gathers.

JAX fixes its device count when its backend starts, and this pytest process already runs on one CPU device, so the mesh
checks run in child processes: tests/support/sharded_worker.py's "meshes" section with 8 CPU devices (meshes 1x8, 2x4,
8x1; adaptive rounds; a DeepSeek-V3 model with latent attention and routed experts on data=2,expert=2,model=2; a hybrid
trunk on data=2,model=4; loading onto a mesh), and `python -m mtp_jax.decode` twice, as two processes of 4 CPU devices
joined by `jax.distributed` on localhost. Expert parallelism and caches split over slots are checked in
tests/parallel/test_expert_parallel.py and tests/parallel/test_slot_sharded_caches.py (the worker's other sections, in
children of their own).
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

from mtp_jax.cli import decode
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.parallel import sharding
from tests.support.commands import ROOT, cpu_env
from tests.support.sharded_worker import (
    DRAFTS,
    HYBRID_MESH,
    IDS,
    LENS,
    MESHES,
    MOE_MESH,
    NEW_TOKENS,
    run_section,
    sharded_config,
)
from tests.support.tiny_models import predictable_model


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_section("meshes", tmp_path_factory.mktemp("sharded"))


def mesh_sizes(spec: str) -> tuple[int, int]:
    sizes = dict(part.split("=") for part in spec.split(","))
    return int(sizes["data"]), int(sizes["model"])


def model_sharded_dim(path: str, shape: list[int], model_size: int) -> int | None:
    """Which dimension tensor parallelism splits, written out per weight (independently of the rules object)."""
    cfg = sharded_config()
    name = path.split("/")[-1]
    kv_split = cfg.num_kv_heads % model_size == 0
    dims = {"embed": 0, "lm_head": 1, "q_proj": -2, "o_proj": -3, "gate_proj": -1, "up_proj": -1, "down_proj": -2}
    if kv_split:
        dims |= {"k_proj": -2, "v_proj": -2}
    return dims[name] % len(shape) if name in dims else None


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("k", DRAFTS)
@pytest.mark.parametrize("mesh", MESHES)
def test_greedy_tokens_match_single_device(report, mesh, k):
    assert report["devices"] == 8
    reference = report["reference"][str(k)]
    run = next(r for r in report["runs"] if r["mesh"] == mesh and r["k"] == k)
    assert run["tokens"] == reference["tokens"]
    assert run["lengths"] == reference["lengths"]
    assert run["finished"] == reference["finished"]
    assert run["accepted"] == reference["accepted"]
    if k:
        assert run["accepted"] > 0  # drafts were accepted, so the sharded accept path ran
    data, _ = mesh_sizes(mesh)
    spec = run["tokens_spec"] + [None] * (2 - len(run["tokens_spec"]))
    assert spec == ["data" if data > 1 else None, None]  # rows stay where they were decoded


@pytest.mark.slow
@pytest.mark.multidevice
def test_reference_is_not_trivial(report):
    """Some rows stop at EOS, some run to the budget, and they have different lengths."""
    lengths = report["reference"]["0"]["lengths"]
    finished = report["reference"]["0"]["finished"]
    assert any(finished) and not all(finished)
    assert NEW_TOKENS in lengths and len(set(lengths)) > 2


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESHES)
def test_tensor_parallel_shards_are_one_over_m(report, mesh):
    _, m = mesh_sizes(mesh)
    split = 0
    for param in report["params"][mesh]:
        shape, shard_shapes = param["shape"], [tuple(s) for s in param["shard_shapes"]]
        dim = model_sharded_dim(param["path"], shape, m)
        expected = list(shape)
        if dim is not None:
            expected[dim] //= m
            split += m > 1
        assert shard_shapes == [tuple(expected)], param
        if dim is not None:
            assert math.prod(shard_shapes[0]) * m == math.prod(shape), param
    if m > 1:
        assert split >= 10  # trunk and MTP layer q/o/gate/up/down, embedding, lm_head


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESHES)
def test_kv_cache_rows_on_data_heads_on_model(report, mesh):
    """[L, B, S, K, H]: rows over data; kv heads over model when it divides them (2 kv heads), else replicated."""
    data, m = mesh_sizes(mesh)
    kv_split = sharded_config().num_kv_heads % m == 0 and m > 1
    expected = [None, "data" if data > 1 else None, None, "model" if kv_split else None, None]
    assert len(report["caches"][mesh]) == 2  # keys and values
    for spec in report["caches"][mesh]:
        assert spec + [None] * (5 - len(spec)) == expected


def weight_sizes(params: list[dict]) -> set[int]:
    """Element counts of every sharded weight, whole, per layer and per expert (what a gather of one would produce)."""
    sizes = set()
    for param in params:
        if any(s is not None for s in param["spec"]):
            sizes.add(math.prod(param["shape"]))
            if "/layers/" in param["path"]:  # stacked: one layer's slice too
                sizes.add(math.prod(param["shape"][1:]))
            if "/expert_" in param["path"]:  # [L, E, ...]: one expert's matrix
                sizes.add(math.prod(param["shape"][2:]))
    return sizes


def full_weight_sizes(report) -> set[int]:
    return set().union(*(weight_sizes(report["params"][mesh]) for mesh in MESHES))


@pytest.mark.slow
@pytest.mark.multidevice
def test_no_all_gather_of_a_full_weight(report):
    """The compiled decode programs (prefill and the round loop, every mesh, with and without MTP)."""
    sizes = full_weight_sizes(report)
    assert sizes
    for run in report["runs"]:
        gathered = [shape for shape in run["all_gathers"] if math.prod(shape) in sizes]
        assert not gathered, f"{run['mesh']} k={run['k']}: all-gathers of weight size {gathered}"


@pytest.mark.slow
@pytest.mark.multidevice
def test_all_gather_check_catches_a_gathered_weight(report):
    """The same check flags a program that reads a sharded weight back whole."""
    assert any(math.prod(shape) in full_weight_sizes(report) for shape in report["control_all_gathers"])


@pytest.mark.slow
@pytest.mark.multidevice
def test_adaptive_rounds_on_a_mesh(report):
    """Draft length picked on device each round (an inner loop per kind of round; the tracker is replicated)."""
    run, reference = report["adaptive"], report["reference"]["0"]
    assert (run["tokens"], run["lengths"]) == (reference["tokens"], reference["lengths"])
    assert run["accepted"] > 0  # rounds with a draft ran
    assert run["tokens_spec"][0] == "data"


@pytest.mark.slow
@pytest.mark.multidevice
def test_draft_trees_on_a_mesh(report):
    """Draft trees over rows on `data` and heads on `model` (GQA), with latent attention and routed experts over
    `expert` (DeepSeek-V3), and on the hybrid trunk's data=2,model=4 (through XLA's delta rule and through the kernel):
    plain decoding's tokens (the tree's path moved to consecutive slots on every shard, each node's DeltaNet state a
    chain's over its path)."""
    for run, reference in (
        (report["tree"], report["reference"]["0"]),
        (report["moe_tree"], report["moe"]["reference"]),
        (report["hybrid_tree"], report["hybrid"]["reference"]),
        (report["hybrid_kernel_tree"], report["hybrid"]["reference"]),
    ):
        assert (run["tokens"], run["lengths"]) == (reference["tokens"], reference["lengths"])
        assert run["tokens_spec"][0] == "data"
    assert report["tree"]["accepted"] > 0 and report["hybrid_tree"]["accepted"] > 0


@pytest.mark.slow
@pytest.mark.multidevice
def test_a_draft_vocabulary_on_a_mesh(report):
    """An MTP head drafting from 16 token ids, its rows split over `model` as the lm_head's vocabulary: one device's
    tokens with a chain and with a tree."""
    run, reference = report["draft_vocab"]["run"], report["draft_vocab"]["reference"]
    assert (run["tokens"], run["lengths"]) == (reference["tokens"], reference["lengths"])
    tree = report["draft_vocab_tree"]
    assert (tree["tokens"], tree["lengths"]) == (reference["tokens"], reference["lengths"])


@pytest.mark.slow
@pytest.mark.multidevice
def test_latent_attention_and_experts_on_an_expert_mesh(report):
    """DeepSeek-V3 (MLA with query LoRA, 16 routed experts in trunk and MTP layer) on data=2,expert=2,model=2."""
    moe = report["moe"]
    assert (moe["run"]["tokens"], moe["run"]["lengths"]) == (moe["reference"]["tokens"], moe["reference"]["lengths"])
    assert moe["run"]["tokens_spec"][0] == "data"
    sizes = dict(part.split("=") for part in MOE_MESH.split(","))
    e, m = int(sizes["expert"]), int(sizes["model"])
    # routed experts over `expert` and their width over `model`; heads, dense and shared-expert MLP width and
    # vocabulary over `model` and `expert` together (every chip a share); the low-rank projections, routers and norms
    # whole (written out per weight, independently of the rules)
    tp = m * e
    splits = {"embed": {0: tp}, "lm_head": {1: tp}, "q_b_proj": {-2: tp}, "kv_b_proj": {-2: tp}, "o_proj": {-3: tp}}
    splits |= {"gate_proj": {-1: tp}, "up_proj": {-1: tp}, "down_proj": {-2: tp}}
    splits |= {"expert_gate": {-3: e, -1: m}, "expert_up": {-3: e, -1: m}, "expert_down": {-3: e, -2: m}}
    for param in moe["params"]:
        expected = list(param["shape"])
        for dim, parts in splits.get(param["path"].split("/")[-1], {}).items():
            expected[dim] //= parts
        assert param["shard_shapes"] == [expected], param
    assert sum("/expert_" in p["path"] for p in moe["params"]) == 6  # trunk segment and MTP layer
    for spec in moe["cache"]:  # latents [L, B, S, C]: rows over data, no head axis
        assert spec + [None] * (4 - len(spec)) == [None, "data", None, None]
    gathered = [s for s in moe["run"]["all_gathers"] if math.prod(s) in weight_sizes(moe["params"])]
    assert not gathered, f"all-gathers of weight size {gathered}"


@pytest.mark.slow
@pytest.mark.multidevice
def test_hybrid_states_on_a_mesh(report):
    """A Qwen3.5-shaped trunk with MTP drafts on data=2,model=4: the same tokens as one device; DeltaNet states with
    rows over data (recurrent states also value heads over model), value heads of the DeltaNet projections over
    model; no weight gathered whole."""
    hybrid = report["hybrid"]
    run, reference = hybrid["run"], hybrid["reference"]
    assert (run["tokens"], run["lengths"]) == (reference["tokens"], reference["lengths"])
    assert run["accepted"] > 0 and run["tokens_spec"][0] == "data"
    m = int(dict(part.split("=") for part in HYBRID_MESH.split(","))["model"])
    out_proj = [p for p in hybrid["params"] if p["path"].endswith("attn/out_proj")]
    for p in out_proj:  # [R, N, Y, D]: value heads over model
        assert p["shard_shapes"] == [[p["shape"][0], p["shape"][1] // m, *p["shape"][2:]]], p
    assert out_proj
    specs = [spec + [None] * (5 - len(spec)) for spec in hybrid["cache"]]
    assert [None, "data", "model", None, None] in specs  # recurrent [R, B, N, H, Y]
    assert [None, "data", None, None, None] in specs  # conv [R, B, W-1, C]
    gathered = [s for s in run["all_gathers"] if math.prod(s) in weight_sizes(hybrid["params"])]
    assert not gathered, f"all-gathers of weight size {gathered}"


@pytest.mark.slow
@pytest.mark.multidevice
def test_hybrid_delta_rule_kernel_on_a_mesh(report):
    """The same trunk and mesh with the delta-rule kernel made available (kernels/delta_rule_kernel.py, Pallas'
    interpreter): it runs per shard (shard_maps beside the trunk's others) and decodes one device's tokens."""
    run, reference = report["hybrid_kernel"], report["hybrid"]["reference"]
    assert run["shard_maps"] > report["hybrid"]["run"]["shard_maps"]
    assert (run["tokens"], run["lengths"]) == (reference["tokens"], reference["lengths"])


@pytest.mark.slow
@pytest.mark.multidevice
def test_uneven_batch_is_refused(report):
    assert "6 rows" in report["batch_error"] and "multiple of 4" in report["batch_error"]


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("kind", ["hf", "converted", "head"])
def test_loading_places_each_parameter_in_its_sharding(report, kind):
    """Streamed from safetensors, restored by orbax, a separately saved head (with a draft vocabulary) attached on
    load: the same values and shardings as sharding in memory."""
    assert report["loaded"][kind] == dict.fromkeys(("same_paths", "same_values", "same_shardings", "same_rules"), True)


def test_mesh_spec():
    assert sharding.parse_mesh_spec("data=2,model=4", 8) == {"data": 2, "expert": 1, "model": 4}
    assert sharding.parse_mesh_spec("model=2,expert=2,data=2", 8) == {"data": 2, "expert": 2, "model": 2}
    assert sharding.parse_mesh_spec("auto", 8) == {"data": 1, "expert": 1, "model": 8}
    for bad in ("data=3,model=2", "data=2,mode=4", "data=0,model=8", "data=2,data=4", "model=x", ""):
        with pytest.raises(ValueError, match="mesh"):
            sharding.parse_mesh_spec(bad, 8)
    with pytest.raises(ValueError, match="has 4 devices but 8 are available"):
        sharding.parse_mesh_spec("data=1,model=4", 8)  # every device, unless a subset is allowed (one process)
    assert sharding.parse_mesh_spec("data=1,model=4", 8, subset=True) == {"data": 1, "expert": 1, "model": 4}
    assert sharding.parse_mesh_spec("auto", 8, subset=True) == {"data": 1, "expert": 1, "model": 8}
    with pytest.raises(ValueError, match="has 9 devices but only 8 are available"):
        sharding.parse_mesh_spec("data=3,model=3", 8, subset=True)


def test_rules_refuse_collisions_and_unknown_axes():
    mesh = sharding.make_mesh("auto")
    with pytest.raises(ValueError, match="two dimensions"):
        sharding.ShardingRules(mesh, head_dim="model")  # q_proj [D, N, H] would split N and H over `model`
    with pytest.raises(ValueError, match="lacks"):
        sharding.ShardingRules(mesh, batch="rows")

    class NewBlock(nnx.Module):  # a parameter created without its logical axes
        def __init__(self):
            self.new_proj = nnx.Param(jnp.zeros((4, 4)))

    with pytest.raises(ValueError, match="parameter new_proj declares no logical axes"):
        sharding.shard_model(NewBlock(), mesh)


@pytest.mark.slow
def test_cli_rejects_a_bad_mesh(tmp_path, capsys):
    save_hf_folder(predictable_model(seed=3, cfg=sharded_config()), tmp_path / "hf")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [1, 2]}) + "\n")
    code = decode.main(["--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--mesh", "data=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: --mesh:") and "available" in err[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multidevice
def test_two_processes_decode_like_one(tmp_path):
    """Two processes x 4 CPU devices, mesh data=2,model=4 over both, three prompts (padded to four rows)."""
    save_hf_folder(predictable_model(seed=3, cfg=sharded_config()), tmp_path / "hf")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": IDS[i, : LENS[i]].tolist()}) + "\n" for i in (1, 3, 5)))
    common = ["--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--num-draft", "2"]
    common += ["--max-new-tokens", str(NEW_TOKENS), "--dtype", "float32"]
    assert decode.main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0

    distributed = [*common, "--mesh", "data=2,model=4", "--out", str(tmp_path / "two.jsonl")]
    distributed += ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mtp_jax.decode", *distributed, "--process-id", str(i)],
            cwd=ROOT,
            env=cpu_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs):
        errors = "\n".join(err for _, err in results)
        lines = [line for line in errors.splitlines() if "ollective" in line or "UNIMPLEMENTED" in line]
        if lines:
            pytest.skip(f"this JAX cannot run CPU collectives across processes: {lines[-1].strip()}")
        pytest.fail(errors[-5000:])
    one = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    two = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert len(two) == 3
    assert two == one
