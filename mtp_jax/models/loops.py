"""Loops over layers, attention chunks and verify tokens, with one switch to unroll them all.

XLA's cost analysis counts a loop's body once, whatever its trip count, so a program's flops and bytes are only
meaningful with its loops unrolled. `python -m mtp_jax.plan` traces the rounds it costs under `unrolled()`;
decoding itself keeps the loops rolled (one compiled body per loop).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_UNROLL: contextvars.ContextVar[bool] = contextvars.ContextVar("mtp_jax_unroll_loops", default=False)


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Trace every model loop in this block fully unrolled (for cost analysis)."""
    token = _UNROLL.set(True)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def scan(f, init, xs):
    """`jax.lax.scan(f, init, xs)`, unrolled under `unrolled()`."""
    return jax.lax.scan(f, init, xs, unroll=_UNROLL.get())


def fori_loop(lower: int, upper: int, body, init):
    """`jax.lax.fori_loop` over a static range, unrolled under `unrolled()`."""
    return jax.lax.fori_loop(lower, upper, body, init, unroll=_UNROLL.get() or None)
