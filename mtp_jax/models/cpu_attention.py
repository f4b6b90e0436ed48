"""Batch-invariant decode attention on a CPU in one call per layer: native/cache_attention.cc, built into the row
kernel's library (models/cpu_rows.py registers both).

The batch-invariant form written with XLA ops (`cache_attention.attend_written_cache`) copies each layer's chunk of
keys and values, with the block's entries merged in, into the layout its products read, and runs a few dozen small
ops a layer: at batch 1 on a 2-core CPU that was about half of a decode step of the default model
(docs/benchmarks.md). The kernel reads keys and values where they lie in the stacked cache, takes the block's
entries for the slots they are written to, and gives each query its softmax over the slots up to its own position,
summed in slot order: a query's result depends on nothing else in the pass, so it is batch-invariant by
construction (its numerics are its own: not the bits of the XLA form).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.models import cpu_rows

LANES = 16  # head dims are whole vectors of this many floats, at most MAX_HEAD_DIM
MAX_HEAD_DIM = 128


def takes(q: jax.Array, past_k, shards: int) -> bool:
    """Whether the kernel can attend these queries [B, T, N, H] over this cache (an array [B, S, K, H] or
    LayerSlots): float32 queries and cache, one run of slots (not split over devices), whole vectors of head dims,
    on a CPU with the row kernel built (`rowwise.attention_rows_exact` is asked by the caller)."""
    head_dim = q.shape[-1]
    return (
        shards == 1
        and q.dtype == jnp.float32
        and past_k.dtype == jnp.float32
        and head_dim % LANES == 0
        and head_dim <= MAX_HEAD_DIM
        and cpu_rows.status() == "ready"
    )


def attend(q, k, v, positions, past_k, past_v, visible_from) -> jax.Array:
    """q [B, T, K, G, H] (scaled), k / v [B, T, K, H] the block's entries, positions [B, T], past_k / past_v one
    layer's cache ([B, S, K, H] or LayerSlots), visible_from [B] or None -> [B, T, K, G, H] float32."""
    caches, layer = [], jnp.zeros((), jnp.int32)
    for past in (past_k, past_v):
        if hasattr(past, "stacked"):  # LayerSlots: read in place from the stack
            caches.append(past.stacked)
            layer = past.layer.astype(jnp.int32)
        else:
            caches.append(past[None])
    b = q.shape[0]
    start = jnp.zeros((b,), jnp.int32) if visible_from is None else visible_from.astype(jnp.int32)
    call = jax.ffi.ffi_call(cpu_rows.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, *caches, layer, k.astype(jnp.float32), v.astype(jnp.float32), positions.astype(jnp.int32), start)
