"""Fixed-shape caches. Attention caches: rows write at their own positions; rollback is by length (attention masks
every slot past the query's position, so rejected drafts are simply overwritten later). Gated DeltaNet states
(hybrid trunks, in a `GroupCache`): rollback is by replay, the verify pass keeping its tokens' inputs and each row
advancing its state before the block over its accepted tokens.

Every cache is a pytree whose leaves are [L, B, S, ...] arrays (layer, batch row, slot = absolute position), in the
order a layer takes them as `past` and returns its new entries (models/causal_lm.py's LayerStack relies on it).

An attention cache is one buffer, updated in place: rows write their entries with dynamic-update-slices (a scatter
would want its own memory layout, the tiles over [kv heads, head dim], while attention reads chunks tiled over
[slots, head dim]: XLA then converted the whole cache between the two every round, a second copy of it in memory),
and on TPU every producer of a cache pins the layout attention reads (`_pinned`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import PartitionSpec

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.config.model import LayerKind, ModelConfig
from mtp_jax.models.cache_attention import ATTENTION_CHUNK, AttentionForm, checked_attention
from mtp_jax.models.gated_deltanet import DeltaNetState, VerifiedBlock
from mtp_jax.ops import loops
from mtp_jax.parallel.sharding import (
    CACHE,
    DELTANET_CONV,
    DELTANET_STATE,
    LATENT_CACHE,
    ShardingRules,
    active_platform,
    active_rules,
    constrain,
    constrain_cache,
)


def write_slots(cache: jax.Array, entries: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [L, B, S, ...] (KVCache's [L, B, S, K, H] or LatentCache's [L, B, S, C]) with entries [L, B, T, ...]
    written at slots `positions` [B, T] (contiguous per row) of their own rows; slots past S are dropped. On a mesh,
    each device writes the rows and slots it holds (`shard_map`), so no cache moves between devices."""
    rules = active_rules()
    if rules is None:
        return _write_rows(cache, entries, positions, 0)
    spec = rules.cache_spec(CACHE if cache.ndim == 5 else LATENT_CACHE, cache.shape, ATTENTION_CHUNK)
    slot_axes = spec[2]  # the mesh axes of a cache split over its slots, or None

    def local(cache, entries, positions):  # this device's rows, and its run of slots
        first = 0 if slot_axes is None else jax.lax.axis_index(slot_axes) * cache.shape[2]
        return _write_rows(cache, entries, positions, first)

    rows = PartitionSpec(*spec[:2], None, *spec[3:])  # entries [L, B, T, ...] split as the cache, bar the slots
    run = jax.shard_map(local, mesh=rules.mesh, in_specs=(spec, rows, PartitionSpec(spec[1], None)), out_specs=spec)
    return run(cache, entries, positions)


def move_slots(cache, start: jax.Array, picks: jax.Array, span: int):
    """An attention cache (KVCache or LatentCache) whose slots start[b] + j, j < T, hold what slots
    start[b] + picks[b, j] held (start [B]; picks [B, T], each in [0, span)): a draft tree's accepted path moved to
    consecutive slots. Reads `span` slots and writes T per row and layer."""

    def moved(stacked: jax.Array) -> jax.Array:  # [L, B, S, ...]
        window = min(stacked.shape[2], span)
        first = jnp.clip(start, 0, stacked.shape[2] - window)  # a window inside the cache
        read = read_windows(stacked, first, window)  # [L, B, window, ...]
        index = jnp.clip(picks + (start - first)[:, None], 0, window - 1)
        index = index.reshape(1, *picks.shape, *(1,) * (stacked.ndim - 3))
        entries = jnp.take_along_axis(read, index, axis=2)  # [L, B, T, ...]
        return write_slots(stacked, entries, start[:, None] + jnp.arange(picks.shape[1]))

    return jax.tree.map(moved, cache).constrained()


UNROLLED_ROWS = 256  # more rows than this are read by one gather: an unrolled slice per row would not compile


def read_windows(cache: jax.Array, first: jax.Array, window: int) -> jax.Array:
    """[L, B, window, ...]: slots first[b] .. first[b] + window - 1 of each row b of cache [L, B, S, ...] (inside
    it), read where they lie: row by row (a gather vmapped over rows had XLA transpose the whole cache to put its
    rows first, and back: four copies of it a round, measured on a TPU plan), on a mesh by each device for the rows
    it holds. A cache split over its slots, where a window may straddle two devices' runs, is read by a gather the
    partitioner places."""
    rules = active_rules()
    if rules is None and cache.shape[1] <= UNROLLED_ROWS:
        return _read_rows(cache, first, window)
    spec = None if rules is None else rules.cache_spec(CACHE if cache.ndim == 5 else LATENT_CACHE, cache.shape,
                                                       ATTENTION_CHUNK)  # fmt: skip
    if spec is None or spec[2] is not None or cache.shape[1] > UNROLLED_ROWS:
        index = (first[:, None] + jnp.arange(window)).reshape(1, -1, window, *(1,) * (cache.ndim - 3))
        return jnp.take_along_axis(cache, index, axis=2)
    rows = PartitionSpec(*spec[:2], None, *spec[3:])  # windows [L, B, W, ...] split as the cache, bar the slots
    read = lambda cache, first: _read_rows(cache, first, window)
    return jax.shard_map(read, mesh=rules.mesh, in_specs=(spec, PartitionSpec(spec[1])), out_specs=rows)(cache, first)


def _read_rows(cache: jax.Array, first: jax.Array, window: int) -> jax.Array:
    """`read_windows` of this device's rows: one dynamic slice per row, unrolled (a loop would carry the cache, and
    XLA copied it into the loop's layout and back, whole)."""
    tail = (0,) * (cache.ndim - 3)
    size = (cache.shape[0], 1, window, *cache.shape[3:])
    return jnp.concatenate([jax.lax.dynamic_slice(cache, (0, b, first[b], *tail), size) for b in range(cache.shape[1])],
                           axis=1)  # fmt: skip


def _write_rows(cache: jax.Array, entries: jax.Array, positions: jax.Array, first) -> jax.Array:
    """cache [L, B, S, ...] holding slots first .. first + S - 1, with entries [L, B, T, ...] written at `positions`
    [B, T] (contiguous per row) where they fall in it: row by row, one dynamic-update-slice of a window of min(S, T)
    slots, inside the cache, that keeps the slots no entry falls on."""
    slots, t = cache.shape[2], entries.shape[2]
    width = min(slots, t)
    entries, positions = entries.astype(cache.dtype), jnp.asarray(positions)
    per_slot = (1, 1, width) + (1,) * (cache.ndim - 3)
    pin = _attention_layout if _on_tpu() else lambda x: x

    def row(b, cache):
        start = positions[b, 0] - first  # the row's first entry's slot in this cache
        corner = jnp.clip(start, 0, slots - width)
        index = corner + jnp.arange(width) - start  # [W] the entry each window slot takes
        window = (0, b, corner) + (0,) * (cache.ndim - 3)
        old = jax.lax.dynamic_slice(cache, window, (cache.shape[0], 1, width, *cache.shape[3:]))  # [L, 1, W, ...]
        new = jnp.take(jax.lax.dynamic_slice_in_dim(entries, b, 1, axis=1), jnp.clip(index, 0, t - 1), axis=2)
        keep = ((index < 0) | (index >= t)).reshape(per_slot)
        return pin(jax.lax.dynamic_update_slice(cache, jnp.where(keep, old, new), window))

    return loops.fori_loop(0, cache.shape[1], row, cache)


def _pinned(x: jax.Array, layout) -> jax.Array:
    """A cache [L, B, S, ...] with logical axes `layout` pinned to its sharding under the active rules
    (ShardingRules.cache_spec) and, on TPU, each device's block to the memory layout attention reads
    (`_attention_layout`; inside `shard_map`, where the partitioner cannot take the layout for a reason to gather)."""
    x = constrain_cache(x, layout, ATTENTION_CHUNK)
    rules = active_rules()
    if not _on_tpu():
        return x
    if rules is None:
        return _attention_layout(x)
    spec = rules.cache_spec(layout, x.shape, ATTENTION_CHUNK)
    return jax.shard_map(_attention_layout, mesh=rules.mesh, in_specs=spec, out_specs=spec)(x)


def _on_tpu() -> bool:
    """Whether the active rules' mesh (else the default backend) is made of TPU devices."""
    return active_platform() == "tpu"


def _attention_layout(x: jax.Array) -> jax.Array:
    """A cache [L, B, S, ...] in the memory layout attention reads it in: the last dim minor, slots next (on TPU,
    tiles over [slots, head dim]). Every producer of a cache pins it, so the decode loop keeps one buffer in one
    layout (a cache in the layout its writes prefer was converted whole for the reads every round)."""
    order = (*(d for d in range(x.ndim - 1) if d != 2), 2, x.ndim - 1)  # major to minor
    return with_layout_constraint(x, Layout(major_to_minor=order))


@struct.dataclass
class KVCache:
    """Keys and values of a stack of attention layers.

    k, v: [L, B, S, K, H] — layer, batch row, cache slot (= absolute position), kv head, head dim.
    """

    k: jax.Array
    v: jax.Array
    attention: AttentionForm = struct.field(
        pytree_node=False, default=AttentionForm.ONE_PASS
    )  # how it is attended: AttentionForm

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, cfg: ModelConfig, dtype, attention=None) -> KVCache:
        """`attention`: its form (models/cache_attention.py: `checked_attention`)."""
        shape = (num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), attention=checked_attention(attention, slots))

    @property
    def invariant(self) -> bool:
        return self.attention == AttentionForm.INVARIANT

    def constrained(self) -> KVCache:
        """This cache pinned to its layout (`_pinned`): under active sharding rules batch -> data, kv_heads -> model,
        or, when `model` does not divide the kv heads and the cache is long, its slots over model."""
        return self.replace(k=_pinned(self.k, CACHE), v=_pinned(self.v, CACHE))

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def bytes_per_token(self) -> int:
        num_layers, _, _, kv_heads, head_dim = self.k.shape
        return 2 * num_layers * kv_heads * head_dim * self.k.dtype.itemsize


@struct.dataclass
class LatentCache:
    """Compressed latents of a stack of multi-head latent attention layers.

    latent: [L, B, S, C] — per token, the normed kv latent (kv_lora_rank dims) then the rotary key shared by all
    heads (qk_rope_head_dim dims): C = kv_lora_rank + qk_rope_head_dim.
    """

    latent: jax.Array
    attention: AttentionForm = struct.field(
        pytree_node=False, default=AttentionForm.ONE_PASS
    )  # how it is attended: AttentionForm

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, cfg: ModelConfig, dtype, attention=None) -> LatentCache:
        """`attention`: its form (models/cache_attention.py: `checked_attention`)."""
        latent = jnp.zeros((num_layers, batch, slots, cfg.mla.latent_dim), dtype)
        return cls(latent=latent, attention=checked_attention(attention, slots))

    @property
    def invariant(self) -> bool:
        return self.attention == AttentionForm.INVARIANT

    def constrained(self) -> LatentCache:
        """This cache pinned to its layout (`_pinned`): under active sharding rules batch -> data and, when long, its
        slots over model and expert; whole on every device otherwise."""
        return self.replace(latent=_pinned(self.latent, LATENT_CACHE))

    @property
    def slots(self) -> int:
        return self.latent.shape[2]

    def bytes_per_token(self) -> int:
        num_layers, _, _, dims = self.latent.shape
        return num_layers * dims * self.latent.dtype.itemsize


def long_cache_shards(cfg: ModelConfig, rules: ShardingRules | None) -> int:
    """M: how many shards `rules` split a long attention cache of this model into over its slots (1 off a mesh, or
    where its kv heads take `model`); mtp_jax.models.kv_cache.cache_slots gives such a cache whole chunks per shard."""
    if rules is None:
        return 1
    layout, heads = (LATENT_CACHE, (cfg.mla.latent_dim,)) if cfg.mla else (CACHE, (cfg.num_kv_heads, cfg.head_dim))
    return math.prod(rules.mesh.shape[axis] for axis in rules.slot_axes(layout, (1, 1, 1, *heads)))  # [L, B, S, ...]


def attention_cache(kind: LayerKind, num_layers: int, batch: int, slots: int, cfg: ModelConfig, dtype, attention=None):
    """An empty cache for `num_layers` layers of this kind: KVCache for GQA, LatentCache for MLA, attended in form
    `attention` (models/cache_attention.py; None: `default_attention(slots)`)."""
    cache_class = LatentCache if kind.attention == "mla" else KVCache
    return cache_class.zeros(num_layers, batch, slots, cfg, dtype, attention).constrained()


def deltanet_states(num_layers: int, batch: int, cfg: ModelConfig, dtype) -> DeltaNetState:
    """Zero states of `num_layers` gated DeltaNet layers: conv [L, B, W-1, C], recurrent [L, B, N, H, Y]."""
    one = DeltaNetState.zeros(batch, cfg.linear_attention, dtype)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_layers, *x.shape)), one)


@struct.dataclass
class TreeEntries:
    """An attention member's keys and values [R, B, T, K, H] for a draft tree's block, not yet in the cache: once the
    accepted path is known, `GroupCache.keep_verified` writes the path's at consecutive slots from `start` [B] (the
    block's attention reads them from the block, so nothing of the tree is written, then moved)."""

    k: jax.Array
    v: jax.Array
    start: jax.Array

    def written_along(self, cache: KVCache, path: jax.Array) -> KVCache:
        """`cache` with the entries of `path` [B, P] (block entries by depth) at slots start .. start + P - 1."""
        slots = self.start[:, None] + jnp.arange(path.shape[1])
        take = lambda a: jnp.take_along_axis(a, path[None, :, :, None, None], axis=2)
        return cache.replace(k=write_slots(cache.k, take(self.k), slots), v=write_slots(cache.v, take(self.v), slots))


@struct.dataclass
class GroupCache:
    """The caches of a repeated layer group (models/hybrid_stack.py), one entry per layer of the group, each stacked
    over the R repeats: KVCache [R, B, S, K, H] for an attention layer, DeltaNetState (conv [R, B, W-1, C],
    recurrent [R, B, N, H, Y]) for a gated DeltaNet. Right after a verify pass, the DeltaNet entries are
    `VerifiedBlock`s [R, B, T, ...] (the block's inputs) until `keep_verified`; after a draft tree's, the attention
    entries are `TreeEntries` until then too."""

    members: tuple
    attention: AttentionForm = struct.field(
        pytree_node=False, default=AttentionForm.ONE_PASS
    )  # its attention members' form

    @property
    def invariant(self) -> bool:
        """Whether its attention caches are attended in the batch-invariant form (and its layers run so)."""
        return self.attention == AttentionForm.INVARIANT

    def constrained(self) -> GroupCache:
        """Pinned to its layout under active sharding rules: rows over data, kv heads and value heads over model."""

        def pin(entry):
            if isinstance(entry, DeltaNetState):
                conv, recurrent = constrain(entry.conv, DELTANET_CONV), constrain(entry.recurrent, DELTANET_STATE)
                return DeltaNetState(conv=conv, recurrent=recurrent)
            return entry.constrained()

        return self.replace(members=tuple(pin(entry) for entry in self.members))

    def keep_verified(
        self, before: GroupCache, accepted: jax.Array, active: jax.Array, path: jax.Array | None = None
    ) -> GroupCache:
        """After a verify pass: each DeltaNet keeps, per row, the state after block position accepted[b] ([B] int),
        and rows not active ([B] bool) their state from `before` exactly; attention entries are kept as written. A
        draft tree's block: the states along `path` [B, D+1] (its accepted path's entries by depth)."""

        def kept(block: VerifiedBlock, prior: DeltaNetState) -> DeltaNetState:
            return (block if path is None else block.along(path)).kept(prior, accepted, active)

        def keep(entry, old):
            if isinstance(entry, TreeEntries):
                return entry.written_along(old, path)
            if not isinstance(entry, VerifiedBlock):
                return entry
            return jax.vmap(kept)(entry, old)

        return self.replace(members=tuple(keep(e, o) for e, o in zip(self.members, before.members, strict=True)))


def decode_attention(prompt_width: int, cfg: DecodeConfig) -> AttentionForm:
    """The form decoding attends its caches in (models/cache_attention.py): "invariant" for batch-invariant decoding
    (`cfg.invariant`); "chunked" when prompt and budget pass one attention chunk, so that attention reads only the
    chunks holding visible slots; "one_pass" otherwise. The choice ignores k, so plain and MTP decoding of the same
    prompts and budget attend alike."""
    if cfg.invariant:
        return AttentionForm.INVARIANT
    return AttentionForm.CHUNKED if prompt_width + cfg.max_new_tokens + 1 > ATTENTION_CHUNK else AttentionForm.ONE_PASS


def cache_slots(prompt_width: int, cfg: DecodeConfig, shards: int = 1) -> int:
    """Cache length: prompt + budget + the slots one round writes from a row's pending position on
    (`DecodeConfig.round_slots`), rounded up to a multiple of 16; for a chunked or invariant form
    (`decode_attention`), to whole chunks on each of `shards` (M) shards of a cache split over its slots
    (`long_cache_shards`). Chunks a row cannot see yet are skipped, so extra ones change nothing."""
    needed = prompt_width + cfg.max_new_tokens + cfg.round_slots
    if decode_attention(prompt_width, cfg) == AttentionForm.ONE_PASS:
        return -(-needed // 16) * 16
    return -(-needed // (shards * ATTENTION_CHUNK)) * shards * ATTENTION_CHUNK
