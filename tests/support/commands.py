"""The repository's root (where the tests start commands and child processes: `python -m tests.support...` runs
from there), and the plan command run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtp_jax.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
