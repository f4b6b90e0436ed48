"""Compiled programs kept whole on disk, so that a warm start skips tracing as well as XLA's compile.

JAX's persistent cache (`compile_cache.py`) finds a program by its lowered module: a warm run still traces and
lowers the decode loop before it looks (most of what a warm compile costs; measured: docs/benchmarks.md#warm-start
and the log's sections it links). This cache finds the executable by what the trace depends on and keeps it
serialized (`jax.experimental.serialize_executable`), so that a hit is a file read and a load.

The key covers: the program's name; each argument's tree, shapes, dtypes and shardings; the static arguments' reprs (the
model's graph definition holds its config and layout); the package's source (every .py, .cc and .h file); the Python,
JAX and jaxlib versions; the backend's devices; every JAX setting; the `MTP_JAX_*` and `XLA_FLAGS` environment; the CPU
row kernel's status; the tracing contexts this package sets (active sharding rules, the execution plan, unrolled loops;
a decode program's plan is in its static config too). A static value whose repr names an address only ever misses.

It is used while `compile_cache.active` is on (the command-line tools), in a single process, for programs whose
arguments all sit on one device; everything else is compiled by JAX as usual. A file that cannot be read back is removed
and the program compiled again. The oldest files go past MAX_FILES.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.ops import loops
from mtp_jax.parallel import sharding
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.cache_folder import cache_dir

MAX_FILES = 64
PARTIAL = ".partial-"  # a file being written
PACKAGE = Path(__file__).resolve().parent.parent  # mtp_jax/: every source file keys the cache


def folder() -> str:
    return os.path.join(cache_dir(), "executables")


def programs(name: str, arguments: tuple, compile_programs: Callable[[], tuple]) -> tuple:
    """The compiled programs `compile_programs()` makes for `arguments` (everything the programs' traces depend on
    beyond the package's code: jit arguments and static values), read from the cache where it holds them."""
    if compile_cache.active_folder() is None or not _one_device(arguments):
        return compile_programs()
    path = os.path.join(folder(), f"{name}-{_key(name, arguments)}.bin")
    loaded = _read(path)
    if loaded is not None:
        compile_cache.count(hit=True)
        return loaded
    compile_cache.count(hit=False)
    with compile_cache.bypassed():  # an executable JAX read from its cache would serialize without its code
        compiled = compile_programs()
    _write(path, compiled)
    return compiled


def _one_device(arguments: tuple) -> bool:
    if jax.process_count() != 1:
        return False
    devices = set()
    for leaf in jax.tree.leaves(arguments):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            devices |= set(sharding.device_set)
    return len(devices) <= 1


def _key(name: str, arguments: tuple) -> str:
    digest = hashlib.sha256()
    for part in (name, _environment(), *(_describe(a) for a in arguments)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def _describe(argument) -> str:
    """The tree, and each leaf's shape, dtype and sharding or, not an array (the model's graph definition, the
    decode settings), its repr."""
    leaves, tree = jax.tree.flatten(argument)
    if not leaves:  # None, an empty container, a node whose aux data the tree's str may not show
        return repr(argument)
    parts = [str(tree)]
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            weak = getattr(leaf, "weak_type", False)
            parts.append(f"{tuple(leaf.shape)} {leaf.dtype} {weak} {getattr(leaf, 'sharding', None)}")
        else:
            parts.append(repr(leaf))
    return "\n".join(parts)


def _environment() -> str:
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MTP_JAX_") or k == "XLA_FLAGS")
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    kernel = cpu_rows.status() if jax.default_backend() == "cpu" else ""  # also registers the kernel's target
    versions = (sys.version, jax.__version__, importlib.metadata.version("jaxlib"))
    tracing = (sharding.active_rules(), traced_plan.current(), loops.unrolling())
    return repr((_source_digest(), versions, devices, settings, env, kernel, tracing))


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc", ".h")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _read(path: str) -> tuple | None:
    try:
        with open(path, "rb") as f:
            stored = pickle.load(f)
        loaded = tuple(serialize_executable.deserialize_and_load(*program) for program in stored)
    except FileNotFoundError:
        return None
    except Exception:  # cut short, or written by a build this one cannot load: compiled again
        _remove(path)
        return None
    try:
        os.utime(path)  # recently used: pruned last
    except OSError:  # removed meanwhile by another process's pruning
        pass
    return loaded


def _write(path: str, compiled: tuple) -> None:
    try:
        stored = pickle.dumps(tuple(serialize_executable.serialize(program) for program in compiled))
    except Exception:  # a program the backend cannot serialize (or that holds constants) is not kept
        return
    partial = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), prefix=PARTIAL, delete=False) as f:
            partial = f.name
            f.write(stored)
        os.replace(partial, path)
    except OSError:  # a full disk, a folder gone: the program is used, not kept
        if partial is not None:
            _remove(partial)
        return
    _prune(os.path.dirname(path))


def _prune(where: str) -> None:
    """The oldest programs past MAX_FILES, and what writers killed an hour ago or more left, removed."""
    try:
        files = sorted(Path(where).glob("*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
        left = [p for p in Path(where).glob(f"{PARTIAL}*") if time.time() - p.stat().st_mtime > 3600]
    except OSError:  # another process pruning at the same time
        return
    for old in files[MAX_FILES:] + left:
        _remove(str(old))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
