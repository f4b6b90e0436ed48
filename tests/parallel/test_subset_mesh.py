"""A mesh over fewer devices than the process has: `make_mesh("data=1,model=4")` on 8 CPU devices takes the first
4, decodes as one device does, and `python -m mtp_jax.decode --mesh` takes it; a mesh larger than the devices is
one line on stderr.

JAX fixes its device count when its backend starts, so these run in child processes with 8 CPU devices:
tests/support/subset_mesh_worker.py, and `python -m mtp_jax.decode` itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.conversion.export import save_hf_folder
from tests.support.commands import ROOT, cpu_env
from tests.support.tiny_models import tiny_config

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]  # 8 CPU devices, in child processes

ROWS = [[5, 6, 7, 8, 9], [11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26]]


def child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=cpu_env(8), capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("subset") / "report.json"
    proc = child("-m", "tests.support.subset_mesh_worker", str(out))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Hugging Face folder with an MTP head (8 query heads: 4 model shards split them) and a prompts file."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_config("deepseek", vocab=40, eos=(2,)).replace(num_heads=8, head_dim=4, max_position_embeddings=64)
    save_hf_folder(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(3)), root / "model")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"token_ids": r}) + "\n" for r in ROWS))
    return root


def test_subset_mesh_is_the_first_devices(report):
    assert report["mesh_shape"] == {"data": 1, "expert": 1, "model": 4}
    assert report["mesh_devices"] == report["first_devices"] == [0, 1, 2, 3]
    assert report["param_devices"] == [0, 1, 2, 3]
    assert report["mesh"]["devices"] == [0, 1, 2, 3]


def test_subset_mesh_decodes_as_one_device(report):
    assert report["mesh"]["tokens"] == report["one_device"]["tokens"]
    assert report["mesh"]["lengths"] == report["one_device"]["lengths"]
    assert max(report["one_device"]["lengths"]) > 1


def test_stream_text_on_a_mesh_with_data_shards(report):
    """A lone prompt on data=2 (its row repeated to fill the shards) streams the one-device answer."""
    one, mesh = report["streamed_one_device"], report["streamed_data_mesh"]
    assert len(one["pieces"]) > 1 and "".join(one["pieces"]) == one["text"]
    assert mesh["pieces"] == one["pieces"] and mesh["text"] == one["text"]


def test_chunks_compiled_ahead_on_a_mesh_with_data_shards(report):
    assert report["compiled_chunks_data_mesh"] == report["compiled_chunks_one_device"]
    assert any(report["compiled_chunks_one_device"][0])


def test_multi_process_runs_keep_every_device(report):
    assert "every device of every process" in report["multi_process_error"]


def test_decode_cli_on_a_subset_mesh(checkpoint, tmp_path, capsys):
    common = ["--model", str(checkpoint / "model"), "--prompts-file", str(checkpoint / "prompts.jsonl")]
    common += ["--max-new-tokens", "10", "--dtype", "float32"]
    proc = child("-m", "mtp_jax.decode", *common, "--mesh", "data=1,model=4", "--out", str(tmp_path / "mesh.jsonl"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert decode_main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0, capsys.readouterr().err
    mesh_rows = [json.loads(line) for line in (tmp_path / "mesh.jsonl").read_text().splitlines()]
    one_rows = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in mesh_rows] == ROWS
    assert [r["token_ids"] for r in mesh_rows] == [r["token_ids"] for r in one_rows]


def test_decode_cli_refuses_a_mesh_larger_than_the_devices(checkpoint):
    proc = child(
        "-m", "mtp_jax.decode", "--model", str(checkpoint / "model"), "--prompt", "hi", "--mesh", "data=3,model=3"
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--mesh" in proc.stderr and "9 devices but only 8" in proc.stderr
