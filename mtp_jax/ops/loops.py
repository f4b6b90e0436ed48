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
import jax.numpy as jnp
from flax import nnx

_UNROLL: contextvars.ContextVar[bool] = contextvars.ContextVar("mtp_jax_unroll_loops", default=False)


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Trace every model loop in this block fully unrolled (for cost analysis)."""
    token = _UNROLL.set(True)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def unrolling() -> bool:
    """Whether loops traced now are unrolled (inside `unrolled()`)."""
    return _UNROLL.get()


def scan(f, init, xs):
    """`jax.lax.scan(f, init, xs)`, unrolled under `unrolled()`."""
    return jax.lax.scan(f, init, xs, unroll=_UNROLL.get())


def fori_loop(lower: int, upper: int, body, init):
    """`jax.lax.fori_loop` over a static range, unrolled under `unrolled()`."""
    return jax.lax.fori_loop(lower, upper, body, init, unroll=_UNROLL.get() or None)


def each_layer(f, init, layers: list):
    """The unstacked twin of `scan`: `f(layers[i], carry, i)` for each i in order, Python-unrolled; the per-layer
    outputs stacked on a new leading axis, as `scan` stacks them."""
    carry, outputs = init, []
    for index, layer in enumerate(layers):
        carry, out = f(layer, carry, index)
        outputs.append(out)
    return carry, jax.tree.map(lambda *parts: jnp.stack(parts), *outputs)


def unstacked_modules(stacked: nnx.Module, count: int) -> list[nnx.Module]:
    """The `count` modules of a module whose parameters carry a leading stacked axis, each with arrays of its own."""
    graphdef, state = nnx.split(stacked)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(count)]
