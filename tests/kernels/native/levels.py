"""Compiling and running tests/kernels/native/row_kernel_check.cc for one ISA level
(tests/kernels/test_kernel_levels_*.py)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from mtp_jax.kernels.cpu import kernel_build

CHECK = Path(__file__).with_name("row_kernel_check.cc")


def host_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


CHECK_OPTIMIZE = "-O1"  # the library's own -O3 takes 2.5x the compile time; the code paths are the level's either way


def build_and_run(tmp_path: Path, compiler: str, march: str, runner: list[str], extra: tuple[str, ...] = ()) -> str:
    """Compile the check with the kernel's own flags for `march` (CHECK_OPTIMIZE for its optimization), run it
    (under `runner`), return its output; fails the test with the check's failures."""
    flags = [f"-march={march}" if f.startswith("-march=") else f for f in kernel_build.flags() if f != "-fPIC"]
    flags = [CHECK_OPTIMIZE if f == kernel_build.OPTIMIZE else f for f in flags]
    binary = tmp_path / f"check-{march.replace('+', '_')}"
    build = [compiler, *flags, *extra, f"-I{kernel_build.NATIVE}", str(CHECK), "-o", str(binary)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    run = subprocess.run([*runner, str(binary)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
    return run.stdout


def isa_of(output: str) -> str:
    return output.splitlines()[0].removeprefix("isa ")


def x86_host_or_skip(needs: set[str]) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"an x86-64 level on a {platform.machine()} host")
    missing = needs - host_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    if shutil.which(kernel_build.compiler()) is None:
        pytest.skip(f"no C++ compiler {kernel_build.compiler()!r}")


def cross_or_skip(compiler: str, emulator: str) -> list[str]:
    """The runner for an AArch64 binary: none on an AArch64 host, else qemu-user (its CPU model with every
    extension, dotprod among them)."""
    if platform.machine() in ("aarch64", "arm64"):
        return []
    missing = [tool for tool in (compiler, emulator) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (Debian: g++-aarch64-linux-gnu, qemu-user)")
    return [emulator, "-cpu", "max"]


def environment_without_march() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != kernel_build.MARCH_ENV}
