"""The CPU row kernel built by the install (setup.py, mtp_jax/kernels/cpu/kernel_build.py) and found by a run.

- The install's build step, run as pip runs it, writes the library into the package under the name a run looks
  for (same sources, compiler, jaxlib and CPU), and replaces an earlier install's library; a compiler that fails
  leaves the install going, with one line, and no library.
- A run loads the installed library and builds nothing; without one it builds into the user's cache (tested with a
  damaged cache in tests/kernels/test_cpu_rows.py), which keeps the newest builds only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_jax.kernels.cpu import cpu_rows, kernel_build

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/bin/sh
# A compiler that compiles nothing: prints a version, or writes the file after -o.
if [ "$1" = "--version" ]; then echo "stub-c++ 1.0"; exit 0; fi
if [ -n "$STUB_FAIL" ]; then echo "stub: error: it failed" >&2; exit 1; fi
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo built > "$2"; fi; shift; done
"""


@pytest.fixture
def stub_compiler(tmp_path, monkeypatch):
    path = tmp_path / "stub-c++"
    path.write_text(STUB)
    path.chmod(0o755)
    monkeypatch.setenv("CXX", str(path))
    return str(path)


def _install_build(build_lib: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(build_lib)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_the_install_writes_the_library_a_run_looks_for(stub_compiler, tmp_path):
    built = tmp_path / "lib" / "mtp_jax" / "kernels" / "cpu" / "native" / "built"
    built.mkdir(parents=True)
    (built / "row_matmul-0123456789abcdef.so").write_text("an earlier install's")
    done = _install_build(tmp_path / "lib")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in built.iterdir()] == [kernel_build.library_name(stub_compiler)]
    assert f"CPU row kernel at {built}" in done.stdout


def test_a_failed_build_leaves_the_install_going(stub_compiler, tmp_path):
    done = _install_build(tmp_path / "lib", env={**os.environ, "STUB_FAIL": "1"})
    assert done.returncode == 0, done.stderr
    assert "CPU row kernel not built at install" in done.stdout and "it failed" in done.stdout
    assert not list((tmp_path / "lib").rglob("row_matmul-*.so"))


@pytest.mark.skipif(cpu_rows.status() != "ready", reason=f"CPU row kernel: {cpu_rows.status()}")
def test_a_run_loads_the_installed_library_and_builds_nothing(monkeypatch, tmp_path):
    installed = tmp_path / "built"
    installed.mkdir()
    shutil.copy(cpu_rows._REGISTERED[0], installed / kernel_build.library_name(kernel_build.compiler()))
    monkeypatch.setattr(kernel_build, "installed_dir", lambda: installed)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def no_build(*args):
        raise RuntimeError("built at run time")

    monkeypatch.setattr(kernel_build, "build", no_build)
    cpu_rows.reset_status()
    try:
        assert cpu_rows.status() == "ready"
        assert not (tmp_path / "cache").exists()
        (installed / kernel_build.library_name(kernel_build.compiler())).unlink()
        cpu_rows.reset_status()
        assert cpu_rows.status() == "off (built at run time)"  # none installed: a run builds it
    finally:
        monkeypatch.undo()
        cpu_rows.reset_status()
    assert cpu_rows.status() == "ready"


def test_the_cache_keeps_the_library_in_use_and_the_newest_others(tmp_path):
    libraries = [tmp_path / f"row_matmul-{i:016x}.so" for i in range(12)]
    for age, path in enumerate(libraries):
        path.write_text("a build")
        os.utime(path, (1e9 + age, 1e9 + age))  # library i built at second i
    (tmp_path / "notes.txt").write_text("not a library")
    kernel_build.prune(tmp_path, libraries[2], others=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["notes.txt", libraries[2].name, *(p.name for p in libraries[5:])]
    )
