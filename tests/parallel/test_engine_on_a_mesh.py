"""An `Engine`'s slots over the mesh's `data` axis (heads over `model`): refilled rows decode as a static batch does
on one device, for a GQA trunk and a hybrid one (DeltaNet states reset per slot)."""

from __future__ import annotations

import pytest

from tests.support.sharded_worker import run_section


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_section("engine", tmp_path_factory.mktemp("engine"))


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("family", ["gqa", "hybrid"])
def test_slots_on_a_mesh_decode_as_one_device(report, family):
    run = report[family]
    expected = [tokens[:length] for tokens, length in zip(run["reference"], run["lengths"], strict=True)]
    assert run["engine"] == expected
    assert len({len(t) for t in expected}) > 1  # rows of different lengths: slots were refilled at different times
    assert run["state_spec"][0] == "data" and "data" in run["cache_spec"]
