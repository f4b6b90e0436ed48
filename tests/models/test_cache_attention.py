"""Grouped-query attention over a fixed-shape cache, chunked (caches of whole chunks) and in one pass, against a
numpy softmax over exactly the slots each query may see."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import execution_plan
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.kernels import traced_plan
from mtp_jax.models.cache_attention import ATTENTION_CHUNK, AttentionForm, default_attention, grouped_attention
from mtp_jax.models.kv_cache import cache_slots, decode_attention

B, T, N, K, H = 3, 4, 6, 2, 8


def reference(q, k, v, positions, past_k, past_v, visible_from):
    """numpy: query t of row b attends to cache slots s with visible_from[b] <= s < positions[b, 0] and to block
    positions u <= t; one softmax over both."""
    out = np.zeros(q.shape)
    group = N // K
    for b in range(B):
        slots = np.arange(past_k.shape[1])
        seen = (slots < positions[b, 0]) & (slots >= visible_from[b])
        for t in range(T):
            for head in range(N):
                kv = head // group
                keys = np.concatenate([past_k[b, seen, kv], k[b, : t + 1, kv]])  # [visible + t + 1, H]
                values = np.concatenate([past_v[b, seen, kv], v[b, : t + 1, kv]])
                scores = keys @ q[b, t, head]
                weights = np.exp(scores - scores.max())
                out[b, t, head] = weights @ values / weights.sum()
    return out


def inputs(slots: int, starts: tuple[int, ...], seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, T, n, H)).astype(np.float32) for n in (N, K, K))
    past_k, past_v = (rng.normal(size=(B, slots, K, H)).astype(np.float32) for _ in range(2))
    positions = (np.asarray(starts)[:, None] + np.arange(T)).astype(np.int32)
    return q, k, v, positions, past_k, past_v


# Rows starting in the first chunk, at a chunk boundary and deep in the last one; one row seeing no cache at all.
@pytest.mark.parametrize(
    ("slots", "starts"),
    [
        (3 * ATTENTION_CHUNK, (5, ATTENTION_CHUNK, 3 * ATTENTION_CHUNK - T)),
        (3 * ATTENTION_CHUNK, (0, 17, ATTENTION_CHUNK + 3)),
        (3 * ATTENTION_CHUNK - 16, (5, ATTENTION_CHUNK, 2 * ATTENTION_CHUNK + 9)),  # not whole chunks: one pass
    ],
)
def test_attention_over_the_cache_matches_numpy(slots, starts):
    q, k, v, positions, past_k, past_v = inputs(slots, starts)
    visible_from = np.array([0, 3, ATTENTION_CHUNK + 1], np.int32)
    visible_from = np.minimum(visible_from, positions[:, 0])
    attention = default_attention(slots)
    got = grouped_attention(q, k, v, positions, past_k, past_v, visible_from, attention)
    np.testing.assert_allclose(got, reference(q, k, v, positions, past_k, past_v, visible_from), atol=2e-5)
    got = grouped_attention(q, k, v, positions, past_k, past_v, attention=attention)
    everything = np.zeros(B, np.int32)
    np.testing.assert_allclose(got, reference(q, k, v, positions, past_k, past_v, everything), atol=2e-5)


def test_a_cache_of_one_chunk_attended_chunked_matches_numpy():
    """One chunk a run (each shard of a cache split over its slots into runs of one chunk) is attended with no loop
    or skip around it: a row seeing no cache at all (start 0) and rows deep in the chunk, against numpy (XLA's form:
    a plan without the attention kernel)."""
    q, k, v, positions, past_k, past_v = inputs(ATTENTION_CHUNK, (0, 17, ATTENTION_CHUNK - T))
    visible_from = np.array([0, 3, 100], np.int32)
    with traced_plan.tracing(execution_plan.xla_only("cpu")):
        got = grouped_attention(q, k, v, positions, past_k, past_v, visible_from, AttentionForm.CHUNKED)
    np.testing.assert_allclose(got, reference(q, k, v, positions, past_k, past_v, visible_from), atol=2e-5)


@pytest.mark.slow
def test_chunked_attention_is_differentiable_like_one_pass():
    """Gradients through the chunked pass (a static-length loop with skipped chunks) equal those of the one-pass
    path on the same visible data: the chunked cache is the one-pass cache padded with slots nobody sees."""
    slots = 2 * ATTENTION_CHUNK
    q, k, v, positions, past_k, past_v = inputs(slots, (3, ATTENTION_CHUNK + 5, 40), seed=1)

    def loss(q, past_k, cache_slots, attention):
        out = grouped_attention(q, k, v, positions, past_k[:, :cache_slots], past_v[:, :cache_slots], None, attention)
        return jnp.sum(jnp.sin(out))

    chunked = jax.grad(loss, argnums=(0, 1))(q, past_k, slots, AttentionForm.CHUNKED)
    one_pass = jax.grad(loss, argnums=(0, 1))(q, past_k, slots - 16, AttentionForm.ONE_PASS)
    np.testing.assert_allclose(chunked[0], one_pass[0], atol=2e-5)
    np.testing.assert_allclose(chunked[1], one_pass[1], atol=2e-5)  # [B, S, K, H]
    assert np.asarray(chunked[1][:, : positions[:, 0].max()]).any()
    assert not np.asarray(chunked[1][:, positions[:, 0].max() :]).any()  # slots nobody sees


def test_plain_and_mtp_caches_take_the_same_attention_path():
    """Whether decoding attends its cache chunk by chunk depends on prompt and budget, not on the number of drafts
    k, so plain and MTP decoding attend the same way (greedy MTP == plain rests on it); every cache holds its need,
    and a chunked one is whole chunks."""
    for prompt in (1, 16, 48, 200, 250, 256, 300):
        for budget in (1, 6, 7, 64, 200, 250, 1000):
            plain = decode_attention(prompt, DecodeConfig(num_draft=0, max_new_tokens=budget))
            for k in (1, 3, 8, 300):
                cfg = DecodeConfig(num_draft=k, max_new_tokens=budget)
                slots = cache_slots(prompt, cfg)
                assert slots >= prompt + budget + k + 1 and slots % 16 == 0
                assert decode_attention(prompt, cfg) == plain, (prompt, budget, k)
                assert plain == AttentionForm.ONE_PASS or slots % ATTENTION_CHUNK == 0
            assert (plain == AttentionForm.CHUNKED) == (prompt + budget + 1 > ATTENTION_CHUNK)


def test_caches_split_over_slots_hold_whole_chunks_per_shard():
    """A long cache split over M shards of slots (kv_cache.long_cache_shards) is whole chunks on every shard, for
    plain and MTP decoding alike, and no larger than that needs; a short one stays one-pass, as on one device."""
    for shards in (2, 4, 8):
        for prompt in (1, 48, 250, 300):
            for budget in (6, 250, 1000):
                for k in (0, 3):
                    cfg = DecodeConfig(num_draft=k, max_new_tokens=budget)
                    slots, needed = cache_slots(prompt, cfg, shards), prompt + budget + k + 1
                    assert needed <= slots < needed + shards * ATTENTION_CHUNK
                    if prompt + budget + 1 > ATTENTION_CHUNK:
                        assert slots % (shards * ATTENTION_CHUNK) == 0 and slots >= shards * ATTENTION_CHUNK
                    else:
                        assert (
                            slots == cache_slots(prompt, cfg)
                            and decode_attention(prompt, cfg) == AttentionForm.ONE_PASS
                        )
