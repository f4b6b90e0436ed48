"""Building the CPU row kernel (native/): its library's name and the compile. Standard library only: `setup.py`
loads this file by path to build the kernel at install time, where neither this package nor JAX can be imported
(the FFI headers come from the build environment's jaxlib).

A library is named by everything its machine code depends on: the sources, the compiler's version, the flags, the
jaxlib whose FFI headers it includes, and this CPU's feature flags (-march=native). `MTP_JAX_NATIVE_MARCH` builds it
for another level (`x86-64-v3`: AVX2 + FMA + F16C; `x86-64-v2`: SSE4; `x86-64`: generic), to run and test here the
code that CPUs of that level get. An install builds it into the
package (`installed_dir`); a run that finds none there with its name builds it into the user's cache
(`cpu_rows.build_dir`), so a library built for another CPU or another jaxlib is never loaded.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NATIVE = Path(__file__).with_name("native")
BINDING, UNIT = NATIVE / "row_matmul.cc", NATIVE / "row_columns.cc"
ATTENTION = NATIVE / "cache_attention.cc"  # the decode attention (kernels/cpu/cpu_attention.py)
UNIT_TYPES = [(x, w) for x in ("float", "uint16_t") for w in ("float", "uint16_t", "int8_t", "U4")]  # ROW_X, ROW_W
MARCH_ENV = "MTP_JAX_NATIVE_MARCH"  # the -march the kernel is built for (default: native)
OPTIMIZE = "-O3"
STALE_SECONDS = 600  # a scratch folder this old was left by a killed build, not one still running


def march() -> str:
    return os.environ.get(MARCH_ENV) or "native"


def flags() -> tuple[str, ...]:
    return (OPTIMIZE, f"-march={march()}", "-ffp-contract=fast", "-std=c++17", "-fPIC", "-Wno-psabi")


def sources() -> list[Path]:
    """Every source file of the kernel (its library's name covers them all)."""
    return sorted(p for p in NATIVE.iterdir() if p.suffix in (".cc", ".h"))


def installed_dir() -> Path:
    """Where an install puts the library (beside the sources, in the installed package or an editable checkout)."""
    return NATIVE / "built"


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def jaxlib_include() -> Path | None:
    """The FFI headers of the jaxlib this environment has (what `jax.ffi.include_dir()` names), found without
    importing it; None without jaxlib."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "include"


def library_name(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        "\n".join(
            [
                *(p.read_text() for p in sources()),
                version,
                importlib.metadata.version("jaxlib"),
                " ".join(flags()),
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    return f"row_matmul-{key}.so"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build(compiler: str, path: Path, include: Path) -> None:
    """Compile the kernel into `path` (written beside it, then renamed: concurrent builders do not collide): the
    binding and one unit per activation and weight type, as many at once as this machine has cores, then linked.
    Raises RuntimeError with the compiler's last line when a step fails."""
    cores = os.cpu_count() or 1
    print(f"mtp_jax: building the CPU row kernel once into {path.parent} ({len(UNIT_TYPES) + 2} units on {cores} "
          "cores)", file=sys.stderr)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob("building-*"):
        if time.time() - stale.stat().st_mtime > STALE_SECONDS:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="building-", dir=path.parent) as scratch:
        units = [[f"-I{include}", str(BINDING)], [f"-I{include}", str(ATTENTION)]]
        units += [[f"-DROW_X={x}", f"-DROW_W={w}", str(UNIT)] for x, w in UNIT_TYPES]
        objects = [os.path.join(scratch, f"unit{i}.o") for i in range(len(units))]
        with concurrent.futures.ThreadPoolExecutor(max_workers=cores) as pool:
            jobs = [[compiler, *flags(), "-c", *unit, "-o", out] for unit, out in zip(units, objects, strict=True)]
            for done in pool.map(
                lambda command: subprocess.run(command, capture_output=True, text=True, timeout=600), jobs
            ):
                _check(compiler, done)
        library = os.path.join(scratch, "row_matmul.so")
        _check(compiler, subprocess.run([compiler, "-shared", *objects, "-o", library], capture_output=True,
                                        text=True, timeout=600))  # fmt: skip
        os.replace(library, path)


def prune(folder: Path, keep: Path, others: int) -> None:
    """Remove the libraries in `folder` but `keep` and the `others` most recently built (a user's cache serves
    several environments: other jaxlibs, other checkouts)."""
    rest = sorted((p for p in folder.glob("row_matmul-*.so") if p != keep), key=_built_at, reverse=True)
    for stale in rest[others:]:
        stale.unlink(missing_ok=True)


def _built_at(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _check(compiler: str, done: subprocess.CompletedProcess) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1] if done.stderr else '?'}")


def build_installed(target: Path) -> str:
    """The install's build (setup.py): the library into `target` under its name, unless it is there. Returns one
    line saying what happened; never raises (without a compiler or jaxlib a run builds it, or stays on XLA)."""
    include = jaxlib_include()
    if include is None or shutil.which(compiler()) is None:
        return f"mtp_jax: CPU row kernel not built at install (no jaxlib or no C++ compiler {compiler()!r})"
    try:
        path = target / library_name(compiler())
        if not path.exists():
            build(compiler(), path, include)
        prune(target, path, others=0)  # an earlier install's, for other sources or another jaxlib
    except (OSError, RuntimeError, subprocess.SubprocessError, importlib.metadata.PackageNotFoundError) as e:
        return f"mtp_jax: CPU row kernel not built at install ({e})"
    return f"mtp_jax: CPU row kernel at {path}"
