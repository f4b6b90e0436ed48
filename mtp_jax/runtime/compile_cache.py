"""JAX's persistent compilation cache for the command-line tools: compiled programs kept on disk under the cache
folder, so a second run with the same model, shapes and settings loads its decode loop instead of compiling it.

On by default for the tools that compile the decode loop; `--no-compile-cache` or `MTP_JAX_NO_COMPILE_CACHE=1` turn
it off. A folder the user gave JAX itself (`JAX_COMPILATION_CACHE_DIR`) is kept. Hits are counted from JAX's
monitoring events, so a caller can tell whether a compile came from the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from mtp_jax.runtime.cache_folder import cache_dir

OFF_ENV = "MTP_JAX_NO_COMPILE_CACHE"
HIT_EVENT, MISS_EVENT = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
MAX_BYTES = 4 << 30  # least recently used programs go past this

_counts = {HIT_EVENT: 0, MISS_EVENT: 0}  # seen in this process (the listener and `count` add to them)
_listening = [False]
_active: list[str] = []  # the folder in use while `active` is on


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-compile-cache", action="store_true", help="compile every program afresh: do not "
                        f"read or write the persistent compilation cache (also ${OFF_ENV}=1)")  # fmt: skip


def folder() -> str:
    """Where compiled programs are kept: `JAX_COMPILATION_CACHE_DIR` when set, else `<cache folder>/xla`."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_dir(), "xla")


@contextlib.contextmanager
def active(off: bool = False) -> Iterator[str | None]:
    """The persistent cache on while the block runs (unless `off`, or `$MTP_JAX_NO_COMPILE_CACHE` is set to anything
    but "" or "0", or the folder cannot be written), JAX's settings as they were after it; yields the folder it
    uses, or None when off. A fresh process must enter it before its first compile: JAX decides once per process
    whether it uses the cache.

    Every program is kept, however small or quick to compile (JAX's defaults keep only those that took a second):
    a run's small programs (placing parameters, splitting keys) add up to a good part of a warm start."""
    if off or os.environ.get(OFF_ENV, "") not in ("", "0"):
        yield None
        return
    path = folder()
    try:
        os.makedirs(path, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:  # JAX would warn on every compile
        print(f"mtp_jax: cannot write the compilation cache {path}; compiling without it", file=sys.stderr)
        yield None
        return
    settings = {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
        "jax_compilation_cache_max_size": MAX_BYTES,
    }
    before = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    if not _listening[0]:
        jax.monitoring.register_event_listener(_on_event)
        _listening[0] = True
    _active.append(path)
    try:
        yield path
    finally:
        _active.pop()
        for name, value in before.items():
            jax.config.update(name, value)


def _on_event(event: str, **kwargs) -> None:
    if event in _counts:
        _counts[event] += 1


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """JAX's persistent cache neither read nor written while the block runs. (JAX decides whether it uses the cache
    once, at the first compile after a reset: the setting alone would not take.)"""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax_compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        jax_compilation_cache.reset_cache()


def active_folder() -> str | None:
    """The cache folder while `active` is on (and not off), else None."""
    return _active[-1] if _active else None


def count(hit: bool) -> None:
    """A program looked for in a cache of ours (`executable_cache`), and read or compiled: counted as JAX's own
    lookups are."""
    _counts[HIT_EVENT if hit else MISS_EVENT] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event in COMPILE_STAGES:
        _compile_time[0] += duration


COMPILE_STAGES = (  # JAX's timed stages of making a program: tracing, lowering, the backend's compile
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_time = [0.0]
jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling programs (reading them from the persistent
    cache included), as JAX times them."""
    return _compile_time[0]


def lookups() -> tuple[int, int]:
    """(programs read from the persistent cache, programs looked for there and compiled) so far in this process."""
    return _counts[HIT_EVENT], _counts[MISS_EVENT]
