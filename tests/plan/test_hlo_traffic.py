"""hlo_traffic.hbm_bytes against bytes counted by hand for small programs compiled on this CPU: a plain matmul reads
its operands and writes its result; an in-place cache update moves the update, not the cache; a layer loop's traffic
grows with its trip count (each iteration reads its layer's slice of the stacked weight, not the stack), rolled or
unrolled alike."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from mtp_jax.plan.hlo_traffic import hbm_bytes

F32 = 4


def compiled_text(f, *args, **jit_kwargs):
    return jax.jit(f, **jit_kwargs).lower(*args).compile()


def test_matmul_reads_operands_and_writes_its_result():
    x, w = jnp.ones((8, 256)), jnp.ones((256, 512))
    compiled = compiled_text(jnp.matmul, x, w)
    assert hbm_bytes(compiled.as_text()) == (8 * 256 + 256 * 512 + 8 * 512) * F32


def test_in_place_cache_update_moves_the_update_not_the_cache():
    cache, update = jnp.zeros((64, 4096, 8)), jnp.ones((64, 1, 8))

    def write(cache, update, position):
        return jax.lax.dynamic_update_slice(cache, update, (0, position, 0))

    compiled = compiled_text(write, cache, update, jnp.int32(3), donate_argnums=0)
    assert hbm_bytes(compiled.as_text()) <= 2 * update.size * F32 + 64  # read and write the update (and position)


def test_layer_loop_traffic_grows_with_its_trip_count():
    d = 256

    def moved(layers: int) -> int:
        stacked = jnp.ones((layers, d, d))  # [L, D, D]

        def run(stacked, x):
            body = lambda i, x: jnp.tanh(x @ jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False))
            return jax.lax.fori_loop(0, layers, body, x)

        total = hbm_bytes(compiled_text(run, stacked, jnp.ones((4, d))).as_text())
        # each iteration reads its [D, D] slice (where XLA materializes the slice first, it also writes and reads
        # that copy: at most 3 slices) and reads and writes [4, D] activations
        assert layers * d * d * F32 <= total <= layers * (3 * d * d + 8 * 4 * d) * F32 + 64 * 1024
        return total

    assert moved(6) == pytest.approx(3 * moved(2), rel=0.05)


def test_rolled_and_unrolled_loops_count_alike():
    stacked, x = jnp.ones((5, 128, 128)), jnp.ones((2, 128))

    def run(stacked, x, unroll):
        body = lambda i, x: x @ stacked[i]
        return jax.lax.fori_loop(0, 5, body, x, unroll=unroll)

    rolled = hbm_bytes(compiled_text(functools.partial(run, unroll=None), stacked, x).as_text())
    unrolled = hbm_bytes(compiled_text(functools.partial(run, unroll=True), stacked, x).as_text())
    assert rolled == pytest.approx(unrolled, rel=0.1)
    assert rolled >= stacked.size * F32


def test_a_conditional_counts_its_costliest_branch():
    """One branch of a conditional runs: a matmul by a [512, 512] weight or by another [512, 256] one. The count
    is the larger branch's, not both branches' (which would add the second weight)."""
    w, u, x = jnp.ones((512, 512)), jnp.ones((512, 256)), jnp.ones((4, 512))

    def run(flag, w, u, x):
        return jax.lax.cond(flag, lambda x: jnp.tanh(x @ w), lambda x: jnp.pad(jnp.tanh(x @ u), ((0, 0), (0, 256))), x)

    total = hbm_bytes(compiled_text(run, True, w, u, x).as_text())
    larger = (w.size + 2 * x.size) * F32
    assert larger <= total < larger + u.size * F32 // 2


def test_a_named_loop_counts_one_iteration_without_what_precedes_it():
    """A program that reads a [512, 512] weight once (its sum) before a while loop named "steps" whose body
    multiplies [4, 512] activations by a [512, 512] weight: one iteration moves that weight and the activations,
    not the first weight; the whole program moves both weights."""
    w, v, x = jnp.ones((512, 512)), jnp.ones((512, 512)), jnp.ones((4, 512))

    def run(w, v, x, n):
        x = x + jnp.sum(w)
        with jax.named_scope("steps"):
            return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (jnp.tanh(c[0] @ v), c[1] + 1), (x, 0))[0]

    hlo = compiled_text(run, w, v, x, jnp.int32(3)).as_text()
    one_step = hbm_bytes(hlo, "steps")
    assert v.size * F32 <= one_step <= (v.size + 4 * x.size) * F32 + 1024
    assert hbm_bytes(hlo) >= one_step + w.size * F32
    with pytest.raises(ValueError, match="one while loop named 'rounds'"):
        hbm_bytes(hlo, "rounds")
