"""Long caches split over their slots on 8 CPU devices (a child process: tests/support/sharded_worker.py's "slots"
section): long prompts where `model` cannot split the attention caches' heads decode as on one device, each device
holding its block of slots; attention over a cache split over slots equals one pass over the same slots."""

from __future__ import annotations

import pytest

from tests.support.sharded_worker import LONG_LENS, LONG_NEW_TOKENS, SLOT_DRAFTS, SLOT_MESHES, SLOT_SHARDS, run_section

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]  # 8 CPU devices, in a child process


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_section("slots", tmp_path_factory.mktemp("slots"))


@pytest.mark.parametrize("k", SLOT_DRAFTS)
@pytest.mark.parametrize("name", list(SLOT_MESHES))
def test_long_caches_split_over_slots_decode_like_one_device(report, name, k):
    """Long prompts where `model` cannot split the attention caches' heads (2 kv heads on model=4; DeepSeek-V3's
    latents): GQA, a hybrid and latent attention, with three drafts a round, give one device's greedy tokens; no
    all-gather brings a cache's slots together."""
    entry = report["slots"][name]
    run, reference = entry["runs"][str(k)], entry["reference"][str(k)]
    for key in ("tokens", "lengths", "finished", "accepted"):
        assert run[key] == reference[key], key
    if k:
        assert run["accepted"] > 0
    if "data=2" in SLOT_MESHES[name]:
        assert run["tokens_spec"][0] == "data"
    assert not [shape for shape in run["all_gathers"] if entry["slots"] in shape]
    assert run["cache_blocks_in_program"] and not run["whole_caches_in_program"]  # generate split its caches too


@pytest.mark.parametrize("name", list(SLOT_MESHES))
def test_long_caches_hold_their_slots_over_model(report, name):
    """[L, B, S, ...] trunk and MTP caches: rows over data, slots over model (latents on a mesh with an expert
    axis: over expert, each device attending the heads model gives it), each device holding S/M slots of its rows;
    whole chunks per shard, and the prompts fill past the first shard."""
    entry, slots = report["slots"][name], report["slots"][name]["slots"]
    sizes = {axis: int(size) for axis, size in (part.split("=") for part in SLOT_MESHES[name].split(","))}
    slot_axes = "model" if sizes.get("expert", 1) == 1 else "expert"
    assert sizes[slot_axes] == SLOT_SHARDS
    assert slots % (SLOT_SHARDS * 256) == 0 and max(LONG_LENS) + LONG_NEW_TOKENS > slots // SLOT_SHARDS
    assert len(entry["caches"]) >= 3  # the trunk's (keys and values, or latents of two segments) and the MTP layer's
    for cache in entry["caches"]:
        shape = cache["shape"]
        assert cache["spec"] + [None] * (len(shape) - len(cache["spec"])) == [
            None,
            "data" if sizes["data"] > 1 else None,
            slot_axes,
        ] + [None] * (len(shape) - 3)
        assert cache["shard_shapes"] == [[shape[0], shape[1] // sizes["data"], slots // SLOT_SHARDS, *shape[3:]]]


def test_attention_over_a_cache_split_over_slots(report):
    """Grouped-query and latent attention (absorbed and expanded) over a cache split into 4 shards of slots, rows
    starting in every shard, against one pass over the same visible slots (float32, random inputs)."""
    attention = report["slot_attention"]
    assert attention["shards"] == {"gqa": 4, "latent": 4}
    for name, error in attention["errors"].items():
        assert error < 1e-5, name
