"""The CPU's decode attention in one call (kernels/cpu/cpu_attention.py, native/cache_attention.cc) against the forms
written with XLA ops (the batch-invariant `cache_attention.attend_written_cache`, and the chunked and one-pass forms
of other decoding, all tested against numpy and transformers in test_cache_attention.py): the same outputs to float32
rounding, over a stacked cache read in place and a layer's own cache, a verify block and a single query, rows at
different positions, with and without `visible_from`; gradients those of the XLA forms; and a query's output the
same bits alone as in any pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.kernels.cpu import cpu_attention, cpu_rows
from mtp_jax.kernels.traced_plan import resolve, tracing
from mtp_jax.models import cache_attention
from mtp_jax.models.cache_attention import AttentionForm

pytestmark = [
    pytest.mark.skipif(cpu_rows.status() != "ready", reason="the CPU row kernel is not built here"),
    pytest.mark.slow,
]

B, K, G, H, S, L = 3, 2, 3, 32, 512, 3


def inputs(t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q = normal(B, t, K * G, H) * 0.3
    starts = jnp.asarray([300, 17, 0], jnp.int32)  # the second chunk, the first, the very first slot
    return q, normal(B, t, K, H), normal(B, t, K, H), starts[:, None] + jnp.arange(t), normal(L, B, S, K, H)


def attend(fused: bool, q, k, v, positions, stack_k, stack_v, visible_from, stacked=True, form=AttentionForm.INVARIANT):
    past = [cache_attention.LayerSlots(s, jnp.int32(1)) if stacked else s[1] for s in (stack_k, stack_v)]

    def run(q, k, v, positions, visible_from):
        with tracing(resolve(invariant=form == AttentionForm.INVARIANT)):
            return cache_attention.grouped_attention(q, k, v, positions, *past, visible_from, form)

    with pytest.MonkeyPatch.context() as patch:
        if not fused:
            patch.setattr(cpu_attention, "takes", lambda *args: False)
        return np.asarray(jax.jit(run)(q, k, v, positions, visible_from))


@pytest.mark.parametrize("form", [AttentionForm.INVARIANT, AttentionForm.CHUNKED, AttentionForm.ONE_PASS])
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("from_slot", [None, 5])
def test_fused_attention_matches_the_xla_forms(form, t, stacked, from_slot):
    q, k, v, positions, stack_k = inputs(t)
    if form == AttentionForm.ONE_PASS:  # a cache of less than a chunk
        stack_k, positions = stack_k[:, :, :200], positions % 190
    stack_v = stack_k[::-1] * 0.5
    visible_from = None if from_slot is None else jnp.asarray([from_slot, 0, 0], jnp.int32)
    fused = attend(True, q, k, v, positions, stack_k, stack_v, visible_from, stacked, form)
    xla = attend(False, q, k, v, positions, stack_k, stack_v, visible_from, stacked, form)
    np.testing.assert_allclose(fused, xla, rtol=1e-5, atol=1e-5)


def test_fused_attention_gradients_are_the_xla_forms():
    q, k, v, positions, stack_k = inputs(2, seed=2)
    stack_v = stack_k * 0.7

    def loss(fused: bool, q, k, v, cache_k, cache_v):
        past = [cache_attention.LayerSlots(c, jnp.int32(1)) for c in (cache_k, cache_v)]
        with pytest.MonkeyPatch.context() as patch:
            if not fused:
                patch.setattr(cpu_attention, "takes", lambda *args: False)
            out = cache_attention.grouped_attention(q, k, v, positions, *past, None, AttentionForm.CHUNKED)
            return jnp.sum(jnp.sin(out))

    grads = [jax.grad(functools.partial(loss, f), argnums=(0, 1, 2, 3, 4))(q, k, v, stack_k, stack_v) for f in (1, 0)]
    for fused, xla in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(fused), np.asarray(xla), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", [AttentionForm.INVARIANT, AttentionForm.CHUNKED])
def test_fused_attention_is_the_same_bits_alone_and_in_any_pass(form):
    q, k, v, positions, stack_k = inputs(4, seed=1)
    stack_v = stack_k * -1.5
    block = attend(True, q, k, v, positions, stack_k, stack_v, None, form=form)
    for row in range(B):
        rows = slice(row, row + 1)
        alone = attend(True, q[rows], k[rows], v[rows], positions[rows], stack_k[:, rows], stack_v[:, rows], None,
                       form=form)  # fmt: skip
        np.testing.assert_array_equal(alone, block[rows])
    # the block's first query alone, as a plain step sees it (the later entries not yet written)
    first = attend(True, q[:, :1], k[:, :1], v[:, :1], positions[:, :1], stack_k, stack_v, None, form=form)
    np.testing.assert_array_equal(first, block[:, :1])
    # its last query as a plain step sees it once the block's earlier entries sit in the cache
    written_k, written_v = stack_k, stack_v
    for i in range(3):
        index = (1, np.arange(B), positions[:, i])
        written_k, written_v = written_k.at[index].set(k[:, i]), written_v.at[index].set(v[:, i])
    last = attend(True, q[:, 3:], k[:, 3:], v[:, 3:], positions[:, 3:], written_k, written_v, None, form=form)
    np.testing.assert_array_equal(last, block[:, 3:])


def test_a_pass_of_many_queries_gives_each_the_bits_of_a_small_pass():
    """Threads claim runs of queries where a pass has many (here 40 x 3 rows of 4 positions: 2,880 queries, runs of
    up to 64): every query is attended once, with the bits it gets in the 3 rows' pass of 72 queries (claimed one at a
    time on a host of a few cores)."""
    q, k, v, positions, stack_k = inputs(4, seed=2)
    stack_v = stack_k * 0.7
    small = attend(True, q, k, v, positions, stack_k, stack_v, None)
    copies = 40
    tiled = lambda x, axis: jnp.concatenate([x] * copies, axis=axis)
    many = attend(True, *(tiled(x, 0) for x in (q, k, v, positions)), tiled(stack_k, 1), tiled(stack_v, 1), None)
    np.testing.assert_array_equal(many, np.concatenate([small] * copies, axis=0))


def test_kernel_matches_its_reference_past_the_cache_and_before_visible_from():
    """A block may lie past the cache's last slot (an MTP cache of fewer slots than positions) or start before
    `visible_from`: its own entries are attended to causally (or by a draft tree's mask) all the same, and only
    cache slots are cut."""
    q, k, v, _, stack_k = inputs(3, seed=3)
    q = q.reshape(B, 3, K, G, H)
    small_k, small_v = stack_k[:, :, :8], stack_k[:, :, 8:16]  # 8 slots
    positions = jnp.asarray([12, 5, 0], jnp.int32)[:, None] + jnp.arange(3)
    start = jnp.asarray([2, 6, 0], jnp.int32)  # row 1: after its block's first position
    layer = jnp.int32(2)
    past = [cache_attention.LayerSlots(c, layer) for c in (small_k, small_v)]
    causal = jnp.zeros((0,), jnp.uint8)
    tree = jnp.broadcast_to(jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (B, 3, 3))  # a root, two children
    for block_mask, mask in ((None, causal), (tree, tree.astype(jnp.uint8))):
        fused = cpu_attention.attend(q, k, v, positions, *past, start, block_mask)
        want = cpu_attention.reference(q, k, v, small_k, small_v, positions, layer, start, mask)
        np.testing.assert_allclose(np.asarray(fused), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(fused), np.asarray(cpu_attention.attend(q, k, v, positions, *past, start)))
