"""A process on a machine without an accelerator does not start libtpu (mtp_jax/runtime/platforms.py): no libtpu noise,
the CPU backend chosen; a TPU signal, or the user's own JAX_PLATFORMS, leaves JAX's choice alone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from mtp_jax.runtime import platforms

PROBE = "import mtp_jax, jax; print(jax.config.jax_platforms, jax.default_backend())"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", *platforms.TPU_VARIABLES)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**base, **env})  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed: nothing to keep quiet")
@pytest.mark.skipif(platforms.accelerator_attached(), reason="an accelerator is attached here")
def test_a_cpu_run_is_quiet_with_libtpu_installed():
    done = _run(PROBE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "cpu"]
    assert "TPU" not in done.stderr and "libtpu" not in done.stderr, done.stderr
    loud = _run("import jax; jax.default_backend()")  # the same process without mtp_jax: libtpu speaks
    assert "TPU" in loud.stderr  # (so the check above can fail)


def test_a_tpu_signal_or_the_users_choice_is_left_alone():
    assert _run("import mtp_jax, jax; print(jax.config.jax_platforms)", TPU_NAME="my-tpu").stdout.strip() == "None"
    chosen = _run("import mtp_jax, jax; print(jax.config.jax_platforms)", JAX_PLATFORMS="cpu")
    assert chosen.stdout.strip() == "cpu"
