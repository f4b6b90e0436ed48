"""Decode attention on a CPU in one call per layer: native/cache_attention.cc, built into the row kernel's library
(kernels/cpu/cpu_rows.py loads both).

The batch-invariant form written with XLA ops (`cache_attention.attend_written_cache`) copies each layer's chunk of
keys and values, with the block's entries merged in, into the layout its products read, and runs a few dozen small
ops a layer: a large share of a batch-1 decode step of the default model on a CPU (measured:
docs/benchmarks-log.md#batch-1-on-a-new-cpu-attention-in-one-kernel-call-and-activations-rounded-to-int8-cpu). The
kernel reads keys and values where they lie in the stacked cache, takes the block's entries for the slots they are
written to, and gives each query its softmax over the cache before its block and, causally, the block, summed in
slot order: a query's result depends on nothing else in the pass, so it is batch-invariant by construction (its
numerics are its own: not the bits of the XLA forms). It serves every pass of batch-invariant decoding and, outside
it, decode steps and verify blocks (`DECODE_POSITIONS`). A draft tree's block takes its mask (each node sees its
ancestors): a node's result is then the bits of a decode step with its path in the cache, so trees run under
batch-invariant decoding too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.kernels.cpu import cpu_rows

DECODE_POSITIONS = 33  # a pass of at most this many positions a row (decode steps, verify blocks, a tree of 32
# nodes and its root, a prompt as short) takes the kernel outside batch-invariant decoding; a longer prefill keeps
# XLA's form (GEMMs)
MAX_HEAD_DIM = 128


def takes(q: jax.Array, past_k, shards: int) -> bool:
    """Whether the kernel can attend these queries [B, T, N, H] over this cache (an array [B, S, K, H] or
    LayerSlots): float32 or bfloat16 queries and cache (bfloat16's values widened exactly), one run of slots (not
    split over devices), at most MAX_HEAD_DIM head dims, on a CPU with the row kernel built
    (the plan's choice, made in kernels/dispatch.py)."""
    head_dim = q.shape[-1]
    return (
        shards == 1
        and q.dtype in (jnp.float32, jnp.bfloat16)
        and past_k.dtype in (jnp.float32, jnp.bfloat16)
        and head_dim <= MAX_HEAD_DIM
        and cpu_rows.status() == "ready"
    )


def attend(q, k, v, positions, past_k, past_v, visible_from, block_mask=None) -> jax.Array:
    """q [B, T, K, G, H] (scaled), k / v [B, T, K, H] the block's entries, positions [B, T], past_k / past_v one
    layer's cache ([B, S, K, H] or LayerSlots), visible_from [B] or None, block_mask [B, T, T] bool (the block
    entries each query sees; None: causally) -> [B, T, K, G, H] float32.
    Differentiable: the gradients are those of `reference` (training an MTP layer through short passes)."""
    caches, layer = [], jnp.zeros((), jnp.int32)
    for past in (past_k, past_v):
        if hasattr(past, "stacked"):  # LayerSlots: read in place from the stack
            caches.append(past.stacked)
            layer = past.layer.astype(jnp.int32)
        else:
            caches.append(past[None])
    b = q.shape[0]
    start = jnp.zeros((b,), jnp.int32) if visible_from is None else visible_from.astype(jnp.int32)
    blocks = k.astype(caches[0].dtype), v.astype(caches[0].dtype)  # as the cache will hold them
    mask = jnp.zeros((0,), jnp.uint8) if block_mask is None else block_mask.astype(jnp.uint8)
    return _attend(q.astype(jnp.float32), *blocks, *caches, positions.astype(jnp.int32), layer, start, mask)


@jax.custom_vjp
def _attend(q, k, v, cache_k, cache_v, positions, layer, start, mask) -> jax.Array:
    call = jax.ffi.ffi_call(
        cpu_rows.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential"
    )
    return call(q, cache_k, cache_v, layer, k, v, positions, start, mask)


def reference(q, k, v, cache_k, cache_v, positions, layer, start, mask) -> jax.Array:
    """What the kernel computes, in XLA's ops (cache_attention's one-pass form, written here: that module imports
    this one): each query [B, T, K, G, H] over layer `layer`'s cache slots [L, B, S, K, H] from start[b] to
    positions[b, 0] - 1 and over the block's entries k / v [B, T, K, H] that `mask` [B, T, T] marks (empty:
    causally)."""
    t = positions.shape[1]
    keys, values = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False) for c in (cache_k, cache_v))
    slot = jnp.arange(keys.shape[1])
    seen = (slot[None, :] < positions[:, :1]) & (slot[None, :] >= start[:, None])  # [B, S]
    past = jnp.einsum("BTKGH,BSKH->BKGTS", q, keys, preferred_element_type=jnp.float32)
    past = jnp.where(seen[:, None, None, None], past, -jnp.inf)
    own = jnp.einsum("BTKGH,BUKH->BKGTU", q, k, preferred_element_type=jnp.float32)
    sees = jnp.tril(jnp.ones((t, t), bool)) if mask.size == 0 else mask.astype(bool)[:, None, None]
    own = jnp.where(sees, own, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([past, own], axis=-1), axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs[..., : slot.size], values, preferred_element_type=jnp.float32)
    return out + jnp.einsum("BKGTU,BUKH->BTKGH", probs[..., slot.size :], v, preferred_element_type=jnp.float32)


def _attend_forward(*operands):
    return _attend(*operands), operands


def _attend_backward(residuals, cotangent):
    q, k, v, cache_k, cache_v, positions, layer, start, mask = residuals
    floats = lambda *a: reference(*a, positions, layer, start, mask)
    _, pullback = jax.vjp(floats, q, k, v, cache_k, cache_v)
    return (*pullback(cotangent), None, None, None, None)


_attend.defvjp(_attend_forward, _attend_backward)


def reads(q: jax.Array, past_k, shards: int, whole_pass: bool) -> bool:
    """Whether the kernel takes this pass where a plan gives it decode attention: decode steps and verify blocks
    (every pass where the batch-invariant form asks: `whole_pass`) that `takes` says it reads. Outside
    batch-invariant decoding, float32 only (a bfloat16 model there keeps XLA's form, not timed against the kernel)."""
    fits = whole_pass or (q.shape[1] <= DECODE_POSITIONS and q.dtype == past_k.dtype == jnp.float32)
    return fits and takes(q, past_k, shards)
