"""Every notebook in notebooks/ runs top to bottom on CPU with its small settings (as CI runs them), and is stored
with its outputs stripped. A cell error, including a failed check inside a notebook (greedy MTP output equal to plain
decoding, one trace of a jitted training step, ...), fails the test."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.commands import ROOT

NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = ["quickstart", "convert_and_shard", "train_mtp_head", "mtp_in_training_loop", "rl_with_mtp_rollouts"]
USES_DEFAULT_MODEL = {"quickstart", "train_mtp_head", "rl_with_mtp_rollouts"}
NEEDS_TUNIX = {"rl_with_mtp_rollouts"}  # runs where the `rl` extra is installed (.ci/run's second environment)
FAKE_DEVICES = {"convert_and_shard", "mtp_in_training_loop"}  # 8 CPU devices in the notebook's kernel


def read(name: str):
    import nbformat

    return nbformat.read(os.path.join(NOTEBOOK_DIR, f"{name}.ipynb"), as_version=4)


def test_the_notebook_list_is_complete():
    found = sorted(f[: -len(".ipynb")] for f in os.listdir(NOTEBOOK_DIR) if f.endswith(".ipynb"))
    assert found == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_outputs_are_stripped(name):
    for cell in read(name).cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: strip outputs before committing"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.multidevice) if n in FAKE_DEVICES else n for n in NOTEBOOKS]
)
def test_notebook_runs(name, tmp_path, monkeypatch, request):
    from nbclient import NotebookClient

    if name in NEEDS_TUNIX:
        pytest.importorskip("tunix", reason="tunix comes with the `rl` extra; .ci/run runs this notebook there")
    if name in USES_DEFAULT_MODEL:
        request.getfixturevalue("smollm2_path")  # fails in CI, skips elsewhere, when the default model is missing
        monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")  # as the `optimized_compiles` fixture (conftest.py)
    # A kernel of this interpreter, whatever kernelspecs the machine has installed.
    kernel_dir = tmp_path / "jupyter" / "kernels" / "mtp_jax_test"
    kernel_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (kernel_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "mtp_jax", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MTP_JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MTP_JAX_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
    notebook = read(name)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="mtp_jax_test", resources={"metadata": {"path": NOTEBOOK_DIR}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
