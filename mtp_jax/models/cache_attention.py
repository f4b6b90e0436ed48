"""Attention of a block of queries over a fixed-shape cache (slot = absolute position) and, causally, over the block
itself, with one softmax over both.

A cache is sized for the longest sequence a call may reach, so early in a long generation most of it is empty. A
cache says how it is attended (its static `attention` field, one of AttentionForm, chosen when it is made:
mtp_jax.decode.speculative.decode_attention for decoding). "chunked" (a cache of whole ATTENTION_CHUNK slots): attention
runs over it chunk by chunk with an online softmax (`attend_in_chunks`: grouped-query attention here, latent
attention in mla.py) and skips every chunk past the slots any row can see: its cost follows the longest row's length,
not the cache's size. "one_pass": one pass over all slots.

On a mesh, a long cache whose head axis cannot take `model` (fewer kv heads than `model` shards, or MLA's latents with
no head axis) is split over its slots instead (`ShardingRules.cache_spec`): M shards of S/M slots,
whole chunks each. The chunked pass views it as [B, M, S/M, ...] and takes local chunk j of every shard at once, as
M * B rows (row b of shard m at m * B + b: the per-row arithmetic is the unsharded one), each keeping its own running
softmax, and merges the M partial softmaxes once at the end: the only reduction across shards, over [B, T, heads, ...].
Queries are whole on every device for it; the output goes back to heads over `model`.

Batch-invariant decoding (DecodeConfig.invariant; the cache's form "invariant") takes another form,
`attend_written_cache`: the block's own keys and values are laid into the chunks where the cache will hold them
(`with_block`) and every query attends chunk by chunk to the slots up to its own position, so its sums never depend
on how many queries, rows or chunks the pass has. The default form attends the cache and the block as two parts, and
a query at block position 1 or later then rounds differently from the same query in a plain step.

Einsum letters: those of layers.py; C slots of one chunk, U the block's own positions. In a chunk's einsums B counts
the M * B rows of every shard.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.kernels.dispatch import attention_implementation, attention_rows_exact, product, row_product
from mtp_jax.ops import loops
from mtp_jax.ops.rowwise import row_sum
from mtp_jax.parallel.sharding import CACHE, HEADS, constrain, constrain_beside_slots, slot_shards

ATTENTION_CHUNK = 256  # cache slots per step of the chunked pass


class AttentionForm(enum.Enum):
    """How a cache is attended (module docstring)."""

    ONE_PASS = "one_pass"
    CHUNKED = "chunked"
    INVARIANT = "invariant"


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

    @property
    def dtype(self):
        return self.stacked.dtype

    def read(self) -> jax.Array:
        """Every slot: [B, S, ...]."""
        start = (self.layer,) + (0,) * (self.stacked.ndim - 1)
        return jax.lax.dynamic_slice(self.stacked, start, (1, *self.shape))[0]

    def read_chunks(self, first, size: int, shards: int) -> jax.Array:
        """Slots first .. first + size - 1 of each of `shards` (M) equal runs of slots: [M * B, size, ...]."""
        stacked = _by_shard(self.stacked, 2, shards)  # [L, B, M, S/M, ...]
        start = (self.layer, 0, 0, first) + (0,) * (stacked.ndim - 4)
        chunks = jax.lax.dynamic_slice(stacked, start, (1, *stacked.shape[1:3], size, *stacked.shape[4:]))[0]
        return _shard_major(chunks)


def layer_entries(stacked: jax.Array, layer: jax.Array | int) -> jax.Array | LayerSlots:
    """Layer `layer`'s entries of a stacked cache array [L, B, S, ...]: read in place (LayerSlots) at a traced
    index (a layer scan's), sliced out at a Python one (unstacked layers). Compiled for TPU, unstacked layers that
    read the stack in place had XLA copy the whole stack into the layout attention reads, once per layer: the cache
    bytes of a step grew with the square of the layer count (measured, in docs/benchmarks-log.md: "fp8 on TPU at
    full depth"). The slice is one layer's."""
    return stacked[layer] if isinstance(layer, int) else LayerSlots(stacked, layer)


def read_slots(past: jax.Array | LayerSlots) -> jax.Array:
    """Every slot of one layer's cache, given as [B, S, ...] or LayerSlots: [B, S, ...]."""
    return past.read() if isinstance(past, LayerSlots) else past


def read_chunks(past: jax.Array | LayerSlots, first, size: int, shards: int) -> jax.Array:
    """Slots first .. first + size - 1 of each of the `shards` (M) equal runs of slots of one layer's cache (given as
    [B, S, ...] or LayerSlots): [M * B, size, ...], run m of row b at row m * B + b. The slice is taken within each
    run, never across the runs, so a cache split over its slots into those runs is read where it lies."""
    if isinstance(past, LayerSlots):
        return past.read_chunks(first, size, shards)
    return _shard_major(jax.lax.dynamic_slice_in_dim(_by_shard(past, 1, shards), first, size, axis=2))


def _by_shard(x: jax.Array, axis: int, shards: int) -> jax.Array:
    """x with its slot axis `axis` (S) viewed as [M, S/M]."""
    return x.reshape((*x.shape[:axis], shards, x.shape[axis] // shards, *x.shape[axis + 1 :]))


def _shard_major(x: jax.Array) -> jax.Array:
    """[B, M, ...] -> [M * B, ...]: the shard axis leads, so rows split over the shards like the slots did."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def default_attention(slots: int) -> AttentionForm:
    """The form a cache of `slots` slots is attended in when its maker does not say: chunked when it is more than one
    whole chunk, one pass otherwise."""
    return AttentionForm.CHUNKED if slots > ATTENTION_CHUNK and slots % ATTENTION_CHUNK == 0 else AttentionForm.ONE_PASS


def checked_attention(attention: AttentionForm | None, slots: int) -> AttentionForm:
    """The form of a new cache of `slots` slots: `attention`, or `default_attention(slots)` when None; an unknown form,
    or a chunked or invariant one over a cache that is not whole chunks, is refused."""
    attention = attention or default_attention(slots)
    if not isinstance(attention, AttentionForm):
        known = ", ".join(form.name for form in AttentionForm)
        raise ValueError(f"unknown attention form {attention!r}; known: AttentionForm's {known}")
    if attention is not AttentionForm.ONE_PASS and slots % ATTENTION_CHUNK:
        raise ValueError(
            f"{attention.value} attention reads whole chunks of {ATTENTION_CHUNK} slots, not a cache of {slots}"
        )
    return attention


def visible_slots(slots: int, positions: jax.Array, visible_from: jax.Array | None, first: int | jax.Array = 0):
    """[B, ..., slots] bool: which of the cache slots first .. first + slots - 1 (`first`: an int, or an array [...]
    of starts, one run of slots each) a block at `positions` [B, T] attends to: those before it (later ones are
    stale: rollback is by length), and none before `visible_from` [B] when given (an MTP cache that skipped
    positions)."""
    slot = jnp.asarray(first)[..., None] + jnp.arange(slots)  # [..., slots]
    row = (-1,) + (1,) * slot.ndim  # [B] -> [B, 1, ..., 1]
    visible = slot < positions[:, 0].reshape(row)
    if visible_from is not None:
        visible &= slot >= visible_from.reshape(row)
    return visible


def block_visibility(block_mask: jax.Array | None, block_scores: jax.Array) -> jax.Array:
    """Which block entries each query attends to, broadcasting against block_scores [B, ..., T, U]: causally
    (entries at or before the query's) without `block_mask`, else `block_mask` [B, T, U] (a draft tree's: each
    node sees its ancestors and itself, decode/tree.py)."""
    t = block_scores.shape[-1]
    if block_mask is None:
        return jnp.tril(jnp.ones((t, t), bool))
    heads = (1,) * (block_scores.ndim - 3)  # the axes between B and T
    return block_mask.reshape(block_mask.shape[0], *heads, *block_mask.shape[1:])


def past_and_block_probs(
    past_scores: jax.Array,  # [..., T, S] float32 scores against the cache
    block_scores: jax.Array,  # [..., T, U] float32 scores within the new block
    positions: jax.Array,  # [B, T]; the leading axis of the scores is B
    visible_from: jax.Array | None = None,  # [B]
    block_mask: jax.Array | None = None,  # [B, T, T]: which block entries each query sees (None: causally)
) -> tuple[jax.Array, jax.Array]:
    """One softmax over the visible cache slots (`visible_slots`) and the block entries each query sees
    (`block_visibility`); returns the two parts of the probabilities."""
    slots = past_scores.shape[-1]
    visible = visible_slots(slots, positions, visible_from)  # [B, S]
    visible = visible.reshape(visible.shape[:1] + (1,) * (past_scores.ndim - 2) + visible.shape[1:])
    past_scores = jnp.where(visible, past_scores, -jnp.inf)
    block_scores = jnp.where(block_visibility(block_mask, block_scores), block_scores, -jnp.inf)
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
    attention: AttentionForm = AttentionForm.ONE_PASS,  # the cache's form
    block_mask: jax.Array | None = None,  # [B, T, T]: the block entries each query sees (None: causally)
) -> jax.Array:
    """[B, T, N, H]: each query head attends, with its kv head, to the cache before the block and to the block
    entries `block_mask` lets it see (causally without one; one softmax over both, float32); chunk by chunk when the
    cache's form is "chunked", shard by shard over one split over its slots; "invariant": the batch-invariant form
    (`attend_written_cache`), which needs a cache of whole chunks on every shard and takes no block mask. On a CPU
    with the row kernel, a decode step or verify block (at most `cpu_attention.DECODE_POSITIONS` positions a row,
    a draft tree's with its mask) outside batch-invariant decoding is one kernel call (kernels/cpu/cpu_attention.py,
    through kernels/dispatch.py); so is every pass under it, a draft tree's too (elsewhere batch-invariant decoding
    takes no tree)."""
    shards = slot_shards(CACHE[1:], past_k.shape, ATTENTION_CHUNK)
    xla_form = lambda: _grouped_attention(
        q, k, v, positions, past_k, past_v, visible_from, attention, shards, block_mask
    )
    decode_pass = attention != AttentionForm.INVARIANT
    kernel = attention_implementation(q, past_k, shards, whole_pass=False) if decode_pass else None
    if kernel is not None:
        b, t, n, h = q.shape
        queries = q.reshape(b, t, k.shape[2], n // k.shape[2], h)  # [B, T, K, G, H]
        fused = lambda: kernel(queries, k, v, positions, past_k, past_v, visible_from, block_mask).astype(q.dtype)
        return jax.lax.platform_dependent(cpu=lambda: fused().reshape(b, t, n, h), default=xla_form)
    return xla_form()


def _grouped_attention(
    q, k, v, positions, past_k, past_v, visible_from, attention: AttentionForm, shards: int, block_mask=None
) -> jax.Array:
    """`grouped_attention` in XLA's ops (the batch-invariant form: the CPU kernel where it takes it)."""
    invariant = attention == AttentionForm.INVARIANT
    b, t, n, h = q.shape
    slots = past_k.shape[1]
    if shards > 1:
        q = constrain_beside_slots(q, CACHE[1:], past_k.shape, ATTENTION_CHUNK)
    q = q.reshape(b, t, k.shape[2], n // k.shape[2], h)  # [B, T, K, G, H]
    f32 = jnp.float32
    if attention != AttentionForm.ONE_PASS:
        q_rows = jnp.tile(q, (shards, 1, 1, 1, 1))  # [M * B, T, K, G, H]: each row's queries beside each shard
        run_starts = whole_chunk_runs(slots, shards) if invariant else None
        entries = (k.astype(past_k.dtype), v.astype(past_v.dtype))  # as the cache will hold them
        exact_rows = invariant and attention_rows_exact(q.dtype)  # no twin for a lone row (dispatch.row_product)
        widen = two_rows if invariant and not exact_rows and q_rows.shape[0] == 1 else lambda x: x
        multiply = row_product if exact_rows else product

        def attend_chunk(first):
            keys = read_chunks(past_k, first, ATTENTION_CHUNK, shards)  # [M * B, C, K, H]
            values = read_chunks(past_v, first, ATTENTION_CHUNK, shards)  # [M * B, C, K, H]
            if invariant:
                starts = run_starts + first
                keys = widen(with_block(keys, entries[0], positions, starts))
                values = widen(with_block(values, entries[1], positions, starts))
            keys, values = keys.astype(q.dtype), values.astype(q.dtype)
            scores = multiply("BTKGH,BCKH->BKGTC", widen(q_rows), keys)
            return scores, lambda probs: multiply("BKGTC,BCKH->BTKGH", probs.astype(q.dtype), values)

        if invariant:
            rows = widen(positions), None if visible_from is None else widen(visible_from)
            written = lambda: attend_written_cache(attend_chunk, *rows, slots, shards, (rows[0].shape[0],
                                                   *q.shape[2:4], t), (rows[0].shape[0], *q.shape[1:]))[:b]  # fmt: skip
            kernel = attention_implementation(q, past_k, shards, whole_pass=True)
            if kernel is not None:  # one kernel call (kernels/cpu/cpu_attention.py)
                fused = lambda: kernel(q, k, v, positions, past_k, past_v, visible_from, block_mask)
                out = fused() if block_mask is not None else jax.lax.platform_dependent(cpu=fused, default=written)
            elif block_mask is not None:
                raise ValueError(
                    "a draft tree under batch-invariant decoding needs the CPU decode attention kernel for this pass "
                    "(float32 or bfloat16, head dims up to 128, one device); decode with a chain"
                )
            else:
                out = written()
        else:
            block_scores = jnp.einsum("BTKGH,BUKH->BKGTU", q, k, preferred_element_type=f32)

            def block_output(probs):  # [B, K, G, T, U] -> [B, T, K, G, H]
                return jnp.einsum("BKGTU,BUKH->BTKGH", probs.astype(q.dtype), v, preferred_element_type=f32)

            out = attend_in_chunks(
                attend_chunk, block_scores, block_output, positions, visible_from, slots, shards, block_mask
            )
        out = out.astype(q.dtype).reshape(b, t, n, h)
        return constrain(out, HEADS) if shards > 1 else out
    block_scores = jnp.einsum("BTKGH,BUKH->BKGTU", q, k, preferred_element_type=f32)
    past_k, past_v = read_slots(past_k).astype(q.dtype), read_slots(past_v).astype(q.dtype)
    past_scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, past_k, preferred_element_type=f32)
    past_probs, block_probs = past_and_block_probs(past_scores, block_scores, positions, visible_from, block_mask)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", past_probs.astype(q.dtype), past_v)
    out = out + jnp.einsum("BKGTU,BUKH->BTKGH", block_probs.astype(q.dtype), v)
    return out.reshape(b, t, n, h)


def two_rows(x: jax.Array) -> jax.Array:
    """x [1, ...] as [2, ...] (the row twice). Where the CPU row kernel does not take attention's products
    (`dispatch.attention_rows_exact`), the batch-invariant form attends a lone row beside a copy of itself: XLA:CPU
    drops a batch axis of size 1 and then emits the attention products with other sums (measured: one row alone
    differed from the same row in batches of 2, 3 and 4, which all agreed)."""
    return jnp.concatenate([x, x])


def whole_chunk_runs(slots: int, shards: int) -> jax.Array:
    """[M] the first slot of each of the `shards` runs of a cache that the batch-invariant form reads; an error
    unless every run is whole chunks (mtp_jax.models.kv_cache.cache_slots sizes invariant decodes so)."""
    if slots % (shards * ATTENTION_CHUNK):
        raise ValueError(
            f"batch-invariant attention reads whole chunks of {ATTENTION_CHUNK} slots on each of {shards} shard(s); "
            f"a cache of {slots} slots is not"
        )
    return jnp.arange(shards) * (slots // shards)


def attend_in_chunks(
    attend_chunk, block_scores, block_output, positions, visible_from, slots: int, shards: int = 1, block_mask=None
):
    """One softmax over the visible slots of a cache of whole chunks and over the block (causally, or as
    `block_mask` [B, T, T] says: `block_visibility`), as a running
    maximum m, normaliser (total) and unnormalised float32 output. Chunk by chunk, each skipped by `lax.cond` when it
    starts at or past every row's first query position, then the block. The loop's trip count is static, so the pass
    stays reverse-differentiable. With `shards` (M) equal runs of slots (a cache split over its slots), step j takes
    chunk j of every run as M * B rows (run m of row b at m * B + b), each with its own running softmax, and the M
    of each row merge after the loop, the one reduction across shards (rows fill run 0 first, so no run needs a chunk
    that run 0 does not).

    attend_chunk(first) -> (float32 scores [M * B, ..., T, C] against slots first .. first + C - 1 of each run, and a
    function of their probabilities giving float32 outputs [M * B, T, ..., W]); block_scores [B, ..., T, U]
    (float32); block_output(probs [B, ..., T, U]) -> [B, T, ..., W]. Returns the float32 output [B, T, ..., W]."""
    heads = (1,) * (block_scores.ndim - 3)  # the axes between B and T

    def visible(starts):  # [M] first slots of this chunk in each run -> [M * B, 1, ..., 1, C]
        seen = visible_slots(ATTENTION_CHUNK, positions, visible_from, starts)  # [B, M, C]
        return _shard_major(seen).reshape(-1, *heads, 1, ATTENTION_CHUNK)

    probe = jax.eval_shape(block_output, jax.ShapeDtypeStruct(block_scores.shape, jnp.float32))  # [B, T, ..., W]
    stats_shape = block_scores.shape[:-1]  # [B, ..., T]
    m, total, acc = _chunk_loop(attend_chunk, visible, jnp.max(positions[:, 0]), slots, shards, stats_shape,
                                probe.shape)  # fmt: skip
    block_scores = jnp.where(block_visibility(block_mask, block_scores), block_scores, -jnp.inf)
    m, rescale, probs = _running_max(m, block_scores)  # each query sees itself: m is finite from here on
    total = total * rescale + jnp.sum(probs, axis=-1)
    acc = acc * _per_query(rescale) + block_output(probs)
    return acc / _per_query(total)


def attend_written_cache(attend_chunk, positions, visible_from, slots: int, shards: int, stats_shape, out_shape):
    """The batch-invariant form of `attend_in_chunks`: the block's entries are already in the chunks
    (`with_block`), and each query attends to the slots up to its own position, chunk by chunk, with no separate
    block part. A query's sums then run over the same chunks, in the same order, with the same values, whatever the
    pass holds besides it (other rows, the rest of a verify block, a longer cache): a chunk a query cannot see adds
    exact zeros to its running softmax, and a chunk skipped because no query of the pass can see it would have.

    attend_chunk as for `attend_in_chunks`; stats_shape [B, ..., T] and out_shape [B, T, ..., W] of the result.
    Returns the float32 output [B, T, ..., W]."""
    heads = (1,) * (len(stats_shape) - 2)  # the axes between B and T

    def visible(starts):  # [M] first slots of this chunk in each run -> [M * B, 1, ..., 1, T, C]
        slot = starts[:, None] + jnp.arange(ATTENTION_CHUNK)  # [M, C]
        seen = slot[:, None, None, :] <= positions[None, :, :, None]  # [M, B, T, C]
        if visible_from is not None:
            seen &= slot[:, None, None, :] >= visible_from[None, :, None, None]
        return seen.reshape(-1, *heads, *seen.shape[2:])

    _, total, acc = _chunk_loop(attend_chunk, visible, jnp.max(positions) + 1, slots, shards, stats_shape, out_shape)
    return acc / _per_query(total)


def with_block(chunk: jax.Array, block: jax.Array, positions: jax.Array, starts: jax.Array) -> jax.Array:
    """chunk [M * B, C, ...] (slots starts[m] .. starts[m] + C - 1 of run m, row b at m * B + b) as it reads once
    the block's entries [B, T, ...] (in the cache's dtype) are written at `positions` [B, T]."""
    shards, (rows, t) = starts.shape[0], block.shape[:2]
    slot = starts[:, None] + jnp.arange(chunk.shape[1])  # [M, C]
    index = slot[:, None, :] - positions[None, :, 0, None]  # [M, B, C] the block entry each slot takes
    inside = ((index >= 0) & (index < t)).reshape(*index.shape, *(1,) * (block.ndim - 2))
    picks = jnp.clip(index, 0, t - 1).reshape(inside.shape)
    entries = jnp.take_along_axis(jnp.broadcast_to(block[None], (shards, *block.shape)), picks, axis=2)
    return jnp.where(inside, entries, chunk.reshape(shards, rows, *chunk.shape[1:])).reshape(chunk.shape)


def _chunk_loop(attend_chunk, visible, used, slots: int, shards: int, stats_shape, out_shape):
    """The running softmax (maximum m [B, ..., T], normaliser, float32 output [B, T, ..., W]) over a cache of
    whole chunks: chunk j of each of the `shards` runs at step j, skipped by `lax.cond` when it starts at or past
    `used` (no query of the pass sees it), then each row's runs merged. visible(starts [M]) -> a mask
    broadcasting against the chunk's scores [M * B, ..., T, C]."""
    run_starts = jnp.arange(shards) * (slots // shards)  # [M] each run's first slot

    def attend(i, carry):
        m, total, acc = carry
        first = i * ATTENTION_CHUNK
        scores, output_of = attend_chunk(first)
        m, rescale, probs = _running_max(m, jnp.where(visible(run_starts + first), scores, -jnp.inf))
        return m, total * rescale + row_sum(probs), acc * _per_query(rescale) + output_of(probs)

    def chunk(i, carry):
        return jax.lax.cond(i * ATTENTION_CHUNK < used, lambda carry: attend(i, carry), lambda carry: carry, carry)

    rows = stats_shape[0] * shards
    f32 = jnp.float32
    start = (
        jnp.full((rows, *stats_shape[1:]), -jnp.inf, f32),
        jnp.zeros((rows, *stats_shape[1:]), f32),
        jnp.zeros((rows, *out_shape[1:]), f32),
    )
    steps = slots // ATTENTION_CHUNK // shards
    # One chunk a run (a cache split over its slots into runs of one chunk): attended with no loop or skip around
    # it, whose carried float32 output XLA writes out and reads back (DeepSeek-V3 on 64 chips at batch 8: 0.5 GiB a
    # step). A chunk no query sees adds exact zeros, as the skip would have.
    runs = attend(0, start) if steps == 1 else loops.fori_loop(0, steps, chunk, start)
    if shards == 1:
        return runs

    def merge(runs):  # each row's M runs under their common maximum
        m, total, acc = (x.reshape(shards, -1, *x.shape[1:]) for x in runs)  # [M, B, ...]
        top = jnp.max(m, axis=0)  # [B, ..., T]
        rescale = jnp.exp(m - _finite(top))  # [M, B, ..., T]
        return top, jnp.sum(total * rescale, axis=0), jnp.sum(acc * _per_query(rescale, 2), axis=0)

    def unseen(runs):  # no chunk was read (a prefill): the maximum -inf, nothing summed
        fills = (-jnp.inf, 0, 0)
        return tuple(jnp.full((stats_shape[0], *x.shape[1:]), fill, f32) for x, fill in zip(runs, fills, strict=True))

    return jax.lax.cond(used > 0, merge, unseen, runs)


def _running_max(m: jax.Array, scores: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold scores [..., X] into the running maximum m [...]: (new maximum, factor for what was summed under the
    old one, exp(scores - new maximum)). Rows with nothing visible yet stay at -inf and add zeros."""
    new = jnp.maximum(m, jnp.max(scores, axis=-1))
    safe = _finite(new)
    return new, jnp.exp(m - safe), jnp.exp(scores - safe[..., None])


def _finite(m: jax.Array) -> jax.Array:
    """A running maximum with -inf (nothing seen yet) as 0, to subtract from scores."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _per_query(x: jax.Array, at: int = 1) -> jax.Array:
    """[B, ..., T] -> [B, T, ..., 1] (T moved to axis `at`), to scale outputs laid out [B, T, ..., W]; with `at` 2,
    [M, B, ..., T] -> [M, B, T, ..., 1] for outputs [M, B, T, ..., W]."""
    return jnp.moveaxis(x, -1, at)[..., None]
