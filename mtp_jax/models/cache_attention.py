"""Attention of a block of queries over a fixed-shape cache (slot = absolute position) and, causally, over the block
itself, with one softmax over both.

A cache is sized for the longest sequence a call may reach, so early in a long generation most of it is empty. When
the cache is a whole number (> 1) of ATTENTION_CHUNK slots (mtp_jax.speculative.cache_slots sizes long decodes so),
attention runs over it chunk by chunk with an online softmax (`attend_in_chunks`: grouped-query attention here, latent
attention in mla.py) and skips every chunk past the slots any row can see: its cost follows the longest row's length,
not the cache's size. Other caches take one pass over all slots.

Einsum letters: those of layers.py; C slots of one chunk, U the block's own positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

ATTENTION_CHUNK = 256  # cache slots per step of the chunked pass


@struct.dataclass
class LayerSlots:
    """One layer's entries of a stacked cache array, read in place: `stacked` [L, B, S, ...] and the layer index
    (int32 []). A layer scan hands these to its layers instead of slicing each layer's [B, S, ...] out of the stack,
    which XLA materializes as a copy of the whole layer cache every step; the chunked pass reads only its chunks."""

    stacked: jax.Array
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stacked.shape[1:]

    def read(self, first, size: int) -> jax.Array:
        """Slots first .. first + size - 1: [B, size, ...]."""
        start = (self.layer, 0, first) + (0,) * (self.stacked.ndim - 3)
        return jax.lax.dynamic_slice(self.stacked, start, (1, self.shape[0], size, *self.shape[2:]))[0]


def read_slots(past: jax.Array | LayerSlots, first=0, size: int | None = None) -> jax.Array:
    """Slots first .. first + size - 1 (default: all) of one layer's cache, given as [B, S, ...] or LayerSlots."""
    size = past.shape[1] if size is None else size
    if isinstance(past, LayerSlots):
        return past.read(first, size)
    return past if size == past.shape[1] else jax.lax.dynamic_slice_in_dim(past, first, size, axis=1)


def chunk_count(slots: int) -> int:
    """Chunks of a cache of `slots` slots for the chunked pass; 0 when it takes the one-pass path."""
    return slots // ATTENTION_CHUNK if slots > ATTENTION_CHUNK and slots % ATTENTION_CHUNK == 0 else 0


def visible_slots(slots: int, positions: jax.Array, visible_from: jax.Array | None, first: int | jax.Array = 0):
    """[B, slots] bool: which of the cache slots first .. first + slots - 1 a block at `positions` [B, T] attends to:
    those before it (later ones are stale: rollback is by length), and none before `visible_from` [B] when given (an
    MTP cache that skipped positions)."""
    slot = first + jnp.arange(slots)[None, :]
    visible = slot < positions[:, :1]
    if visible_from is not None:
        visible &= slot >= visible_from[:, None]
    return visible


def past_and_block_probs(
    past_scores: jax.Array,  # [..., T, S] float32 scores against the cache
    block_scores: jax.Array,  # [..., T, U] float32 scores within the new block
    positions: jax.Array,  # [B, T]; the leading axis of the scores is B
    visible_from: jax.Array | None = None,  # [B]
) -> tuple[jax.Array, jax.Array]:
    """One softmax over the visible cache slots (`visible_slots`) and, causally, the block itself; returns the two
    parts of the probabilities."""
    slots, t = past_scores.shape[-1], block_scores.shape[-1]
    visible = visible_slots(slots, positions, visible_from)  # [B, S]
    visible = visible.reshape(visible.shape[:1] + (1,) * (past_scores.ndim - 2) + visible.shape[1:])
    past_scores = jnp.where(visible, past_scores, -jnp.inf)
    block_scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), block_scores, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([past_scores, block_scores], axis=-1), axis=-1)
    return probs[..., :slots], probs[..., slots:]


def grouped_attention(
    q: jax.Array,  # [B, T, N, H] queries, already scaled
    k: jax.Array,  # [B, T, K, H] this block's keys
    v: jax.Array,  # [B, T, K, H] this block's values
    positions: jax.Array,  # [B, T] absolute positions, contiguous per row
    past_k: jax.Array | LayerSlots,  # [B, S, K, H] the cache; slots >= positions[:, 0] are ignored
    past_v: jax.Array | LayerSlots,  # [B, S, K, H]
    visible_from: jax.Array | None = None,  # [B]: slots before it are ignored too
) -> jax.Array:
    """[B, T, N, H]: each query head attends, with its kv head, to the cache before the block and causally to the
    block itself (one softmax over both, float32); chunk by chunk over a cache of whole chunks (`chunk_count`)."""
    b, t, n, h = q.shape
    q = q.reshape(b, t, k.shape[2], n // k.shape[2], h)  # [B, T, K, G, H]
    f32 = jnp.float32
    block_scores = jnp.einsum("BTKGH,BUKH->BKGTU", q, k, preferred_element_type=f32)
    if chunk_count(past_k.shape[1]):

        def attend_chunk(first):
            keys = read_slots(past_k, first, ATTENTION_CHUNK).astype(q.dtype)  # [B, C, K, H]
            values = read_slots(past_v, first, ATTENTION_CHUNK).astype(q.dtype)  # [B, C, K, H]
            scores = jnp.einsum("BTKGH,BCKH->BKGTC", q, keys, preferred_element_type=f32)
            return scores, lambda probs: jnp.einsum("BKGTC,BCKH->BTKGH", probs.astype(q.dtype), values,
                                                    preferred_element_type=f32)  # fmt: skip

        def block_output(probs):  # [B, K, G, T, U] -> [B, T, K, G, H]
            return jnp.einsum("BKGTU,BUKH->BTKGH", probs.astype(q.dtype), v, preferred_element_type=f32)

        out = attend_in_chunks(attend_chunk, block_scores, block_output, positions, visible_from, past_k.shape[1])
        return out.astype(q.dtype).reshape(b, t, n, h)
    past_k, past_v = read_slots(past_k).astype(q.dtype), read_slots(past_v).astype(q.dtype)
    past_scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, past_k, preferred_element_type=f32)
    past_probs, block_probs = past_and_block_probs(past_scores, block_scores, positions, visible_from)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", past_probs.astype(q.dtype), past_v)
    out = out + jnp.einsum("BKGTU,BUKH->BTKGH", block_probs.astype(q.dtype), v)
    return out.reshape(b, t, n, h)


def attend_in_chunks(attend_chunk, block_scores, block_output, positions, visible_from, slots: int) -> jax.Array:
    """One softmax over the visible slots of a cache of whole chunks and, causally, over the block, as a running
    maximum m, normaliser (total) and unnormalised float32 output. Chunk by chunk, each skipped by `lax.cond` when it
    starts at or past every row's first query position, then the block. The loop's trip count is static, so the pass
    stays reverse-differentiable.

    attend_chunk(first) -> (float32 scores [B, ..., T, C] against slots first .. first + C - 1, and a function of
    their probabilities giving float32 outputs [B, T, ..., W]); block_scores [B, ..., T, U] (float32);
    block_output(probs [B, ..., T, U]) -> [B, T, ..., W]. Returns the float32 output [B, T, ..., W]."""
    used = jnp.max(positions[:, 0])  # no row sees a slot at or past it
    heads = (1,) * (block_scores.ndim - 3)  # the axes between B and T

    def chunk(i, carry):
        def attend(carry):
            m, total, acc = carry
            first = i * ATTENTION_CHUNK
            scores, output_of = attend_chunk(first)
            visible = visible_slots(ATTENTION_CHUNK, positions, visible_from, first)  # [B, C]
            scores = jnp.where(visible.reshape(visible.shape[:1] + heads + (1,) + visible.shape[1:]), scores, -jnp.inf)
            m, rescale, probs = _running_max(m, scores)
            return m, total * rescale + jnp.sum(probs, axis=-1), acc * _per_query(rescale) + output_of(probs)

        return jax.lax.cond(i * ATTENTION_CHUNK < used, attend, lambda carry: carry, carry)

    stats_shape = block_scores.shape[:-1]  # [B, ..., T]
    probe = jax.eval_shape(block_output, jax.ShapeDtypeStruct(block_scores.shape, jnp.float32))
    f32 = jnp.float32
    start = (jnp.full(stats_shape, -jnp.inf, f32), jnp.zeros(stats_shape, f32), jnp.zeros(probe.shape, f32))
    m, total, acc = jax.lax.fori_loop(0, chunk_count(slots), chunk, start)
    t = block_scores.shape[-1]
    block_scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), block_scores, -jnp.inf)
    m, rescale, probs = _running_max(m, block_scores)  # each query sees itself: m is finite from here on
    total = total * rescale + jnp.sum(probs, axis=-1)
    acc = acc * _per_query(rescale) + block_output(probs)
    return acc / _per_query(total)


def _running_max(m: jax.Array, scores: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold scores [..., X] into the running maximum m [...]: (new maximum, factor for what was summed under the
    old one, exp(scores - new maximum)). Rows with nothing visible yet stay at -inf and add zeros."""
    new = jnp.maximum(m, jnp.max(scores, axis=-1))
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    return new, jnp.exp(m - safe), jnp.exp(scores - safe[..., None])


def _per_query(x: jax.Array) -> jax.Array:
    """[B, ..., T] -> [B, T, ..., 1], to scale outputs laid out [B, T, ..., W]."""
    return jnp.moveaxis(x, -1, 1)[..., None]
