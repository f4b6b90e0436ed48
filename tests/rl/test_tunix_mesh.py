"""`MtpRollout` on a tunix mesh of 4 CPU devices (fsdp=2, tp=2), in a child process (tests/rl/mesh_worker.py): the
policy laid out as tunix lays out its actor, the engine's model split over the same devices, its greedy rollouts
before and after a weight sync equal to the engine's on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tunix", reason="tunix comes with the `rl` extra; .ci/run tests it in an environment of its own")

from tests.support.commands import ROOT


@pytest.mark.multidevice
def test_rollouts_on_a_tunix_mesh_equal_one_device_s(tmp_path):
    out = tmp_path / "mesh.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "tests.rl.mesh_worker", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["devices"] == 4
    assert seen["mesh"] == seen["one_device"]  # before and after the sync
    assert seen["mesh"][0] != seen["mesh"][1]  # the sync moved the policy
    assert seen["embed_devices"] == 4 and seen["q_proj_shard"] == [2, 32, 2, 8]  # heads split over tp
    assert seen["slots"] % 2 == 0 and seen["accepted"] > 0  # rows split over fsdp
