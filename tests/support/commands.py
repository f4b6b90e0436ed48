"""The repository's root (where the tests start commands and child processes: `python -m tests.support...` runs
from there), the environment of a child with several host devices, and the plan command: run as a user runs it (a
child process), or in the test's own process."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_env(devices: int) -> dict:
    """A child process's environment: `devices` CPU devices, the suite's compile flags kept (XLA_FLAGS extended, not
    replaced) and LLVM's optimizations off (compiles take half the time; the partitioned programs, their collectives
    and the comparisons made within one child are unchanged)."""
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(), "JAX_PLATFORMS": "cpu"}


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtp_jax.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )


def plan_in_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m mtp_jax.plan ARGS` run in this process, as `run_plan` reports it (exit status, stdout, stderr):
    no start-up of JAX and libtpu per plan. What the command sets for its process (the optimizations flag, the
    environment) is put back afterwards. Not for `cpu:N` topologies: they need host devices asked for before JAX
    starts."""
    from mtp_jax.cli import plan

    out, err = io.StringIO(), io.StringIO()
    environment, optimizations = dict(os.environ), jax.config.values["jax_disable_most_optimizations"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = plan.main(list(args))
            except SystemExit as e:  # argparse's refusals
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(environment)
        jax.config.update("jax_disable_most_optimizations", optimizations)
    return subprocess.CompletedProcess(["python", "-m", "mtp_jax.plan", *args], code, out.getvalue(), err.getvalue())
