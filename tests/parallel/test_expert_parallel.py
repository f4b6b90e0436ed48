"""Expert parallelism on 8 CPU devices (a child process: tests/support/sharded_worker.py's "experts" section):
DeepSeek-V3, GLM-4.5 and a Qwen3.5-MoE-shaped hybrid decode with their routed experts over 2, 4 or 8 `expert` shards as
on one device, each device holding its experts' share; the routed-experts layers on expert meshes equal one device."""

from __future__ import annotations

import math

import pytest

from tests.support.sharded_worker import EXPERT_RUNS, LAYER_MESHES, run_section

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]  # 8 CPU devices, in a child process


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_section("experts", tmp_path_factory.mktemp("experts"))


def expert_run(report, name: str, mesh: str, k: int) -> dict:
    return next(r for r in report["expert_parallel"]["runs"] if (r["model"], r["mesh"], r["k"]) == (name, mesh, k))


@pytest.mark.parametrize(("name", "mesh", "k"), [(name, mesh, k) for name, mesh, drafts in EXPERT_RUNS for k in drafts])
def test_expert_parallel_tokens_match_single_device(report, name, mesh, k):
    """DeepSeek-V3, GLM-4.5 and a Qwen3.5-MoE-shaped hybrid with their routed experts over 2, 4 or 8 `expert` shards
    (the rows going to the experts inside shard_map), plain and with MTP drafts: the same tokens as one device."""
    run, reference = expert_run(report, name, mesh, k), report["expert_parallel"]["reference"][name][str(k)]
    for key in ("tokens", "lengths", "finished", "accepted"):
        assert run[key] == reference[key], key
    if k:
        assert run["accepted"] > 0  # drafts accepted: the MTP layer's experts and the verify path ran
    assert run["shard_maps"] > 0 and reference["shard_maps"] == 0
    if int(dict(part.split("=") for part in mesh.split(","))["data"]) > 1:
        assert run["tokens_spec"][0] == "data"


@pytest.mark.parametrize(("name", "mesh"), [(name, mesh) for name, mesh, _ in EXPERT_RUNS])
def test_expert_parallel_weights_stay_in_their_shards(report, name, mesh):
    """Each device holds E/expert experts, F/model of their width (written out per weight); no expert weight gathered,
    whole or in part."""
    runs = [r for r in report["expert_parallel"]["runs"] if (r["model"], r["mesh"]) == (name, mesh)]
    params = next(r["params"] for r in runs if "params" in r)
    sizes = dict(part.split("=") for part in mesh.split(","))
    e, m = int(sizes["expert"]), int(sizes["model"])
    splits = {"expert_gate": {-3: e, -1: m}, "expert_up": {-3: e, -1: m}, "expert_down": {-3: e, -2: m}}
    experts = [p for p in params if p["path"].split("/")[-1] in splits]
    assert len(experts) >= 6  # trunk and MTP layer
    for param in experts:
        expected = list(param["shape"])
        for dim, parts in splits[param["path"].split("/")[-1]].items():
            expected[dim] //= parts
        assert param["shard_shapes"] == [expected], param
    sizes = expert_gather_sizes(params)
    assert sizes
    gathered = [s for r in runs for s in r["all_gathers"] if math.prod(s) in sizes]
    assert not gathered, f"all-gathers of expert weight size {gathered}"


def expert_gather_sizes(params: list[dict]) -> set[int]:
    """Element counts of gathered routed-expert weights (shard_map in_specs other than the stored layouts gather
    them): one layer or all, one expert, a device's experts or all, with the experts or their width gathered."""
    sizes = set()
    for param in params:
        name = param["path"].split("/")[-1]
        if name not in ("expert_gate", "expert_up", "expert_down"):
            continue
        (shard,), shape = param["shard_shapes"], param["shape"]
        f = -2 if name == "expert_down" else -1  # [..., E, F, D] or [..., E, D, F]
        d = shape[-1] if name == "expert_down" else shape[-2]
        for layers in {1, math.prod(shape[:-3])}:
            for experts in {1, shard[-3], shape[-3]}:
                for width in {shard[f], shape[f]}:
                    if experts > shard[-3] or width > shard[f]:
                        sizes.add(layers * experts * width * d)
    return sizes


@pytest.mark.parametrize("layer", ["MoE", "SoftmaxMoE"])
def test_expert_parallel_layer_equals_one_device(report, layer):
    """The routed-experts layer (float32, random inputs) on expert meshes against one device: one shard_map with one
    psum; with many rows every expert shard has some, with two rows some shards have none."""
    results = [r for r in report["expert_layers"] if r["layer"] == layer]
    assert sorted((r["mesh"], r["rows"]) for r in results) == sorted((m, n) for m in LAYER_MESHES for n in (32, 2))
    for r in results:
        assert r["max_error"] < 1e-5, r
        assert (r["shard_maps"], r["psums"]) == (1, 1), r
    assert all(r["shards_with_rows"] == list(range(r["expert_shards"])) for r in results if r["rows"] == 32)
    assert any(len(r["shards_with_rows"]) < r["expert_shards"] for r in results if r["rows"] == 2)
