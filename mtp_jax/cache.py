"""Fixed-shape caches. Attention caches: rows write at their own positions; rollback is by length (attention masks
every slot past the query's position, so rejected drafts are simply overwritten later). Gated DeltaNet states
(hybrid trunks, in a `GroupCache`): rollback is by selection, the verify pass giving the state after every position.

Every cache is a pytree whose leaves are [L, B, S, ...] arrays (layer, batch row, slot = absolute position), in the
order a layer takes them as `past` and returns its new entries (models/causal_lm.py's LayerStack relies on it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.config import LayerKind, ModelConfig
from mtp_jax.models.gated_deltanet import DeltaNetState
from mtp_jax.sharding import CACHE, DELTANET_CONV, DELTANET_STATE, constrain

LATENT_CACHE = ("layers", "batch", "seq", None)  # [L, B, S, C]: no head axis to shard


def write_slots(cache: jax.Array, entries: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [L, B, S, ...] with entries [L, B, T, ...] written at slots `positions` [B, T] of their own rows; slots
    past S are dropped. The row is a batching dimension of the scatter, not an index, so a cache sharded over rows
    is updated where it lies (an index scatter would make XLA gather every row's entries on every device)."""
    trailing = tuple(range(3, cache.ndim))
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(0, *trailing),
        inserted_window_dims=(2,),
        scatter_dims_to_operand_dims=(2,),
        operand_batching_dims=(1,),
        scatter_indices_batching_dims=(0,),
    )
    drop = jax.lax.GatherScatterMode.FILL_OR_DROP
    return jax.lax.scatter(cache, positions[..., None], entries.astype(cache.dtype), numbers, mode=drop)


@struct.dataclass
class KVCache:
    """Keys and values of a stack of attention layers.

    k, v: [L, B, S, K, H] — layer, batch row, cache slot (= absolute position), kv head, head dim.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, cfg: ModelConfig, dtype) -> KVCache:
        shape = (num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def constrained(self) -> KVCache:
        """This cache pinned to its layout under active sharding rules (batch -> data, kv_heads -> model)."""
        return KVCache(k=constrain(self.k, CACHE), v=constrain(self.v, CACHE))

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

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, cfg: ModelConfig, dtype) -> LatentCache:
        return cls(latent=jnp.zeros((num_layers, batch, slots, cfg.mla.latent_dim), dtype))

    def constrained(self) -> LatentCache:
        """This cache pinned to its layout under active sharding rules (batch -> data, the rest replicated)."""
        return LatentCache(latent=constrain(self.latent, LATENT_CACHE))

    @property
    def slots(self) -> int:
        return self.latent.shape[2]

    def bytes_per_token(self) -> int:
        num_layers, _, _, dims = self.latent.shape
        return num_layers * dims * self.latent.dtype.itemsize


def attention_cache(kind: LayerKind, num_layers: int, batch: int, slots: int, cfg: ModelConfig, dtype):
    """An empty cache for `num_layers` layers of this kind: KVCache for GQA, LatentCache for MLA."""
    cache_class = LatentCache if kind.attention == "mla" else KVCache
    return cache_class.zeros(num_layers, batch, slots, cfg, dtype).constrained()


def deltanet_states(num_layers: int, batch: int, cfg: ModelConfig, dtype) -> DeltaNetState:
    """Zero states of `num_layers` gated DeltaNet layers: conv [L, B, W-1, C], recurrent [L, B, N, H, Y]."""
    one = DeltaNetState.zeros(batch, cfg.linear_attention, dtype)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_layers, *x.shape)), one)


@struct.dataclass
class GroupCache:
    """The caches of a repeated layer group (models/hybrid_stack.py), one entry per layer of the group, each stacked
    over the R repeats: KVCache [R, B, S, K, H] for an attention layer, DeltaNetState (conv [R, B, W-1, C],
    recurrent [R, B, N, H, Y]) for a gated DeltaNet. Right after a verify pass, the DeltaNet entries hold the state
    after every block position (conv [R, B, T, W-1, C], recurrent [R, B, T, N, H, Y]) until `keep_verified`."""

    members: tuple

    def constrained(self) -> GroupCache:
        """Pinned to its layout under active sharding rules: rows over data, kv heads and value heads over model."""

        def pin(entry):
            if isinstance(entry, DeltaNetState):
                conv, recurrent = constrain(entry.conv, DELTANET_CONV), constrain(entry.recurrent, DELTANET_STATE)
                return DeltaNetState(conv=conv, recurrent=recurrent)
            return entry.constrained()

        return GroupCache(members=tuple(pin(entry) for entry in self.members))

    def keep_verified(self, before: GroupCache, accepted: jax.Array, active: jax.Array) -> GroupCache:
        """After a verify pass: each DeltaNet keeps, per row, the state after block position accepted[b] ([B] int),
        and rows not active ([B] bool) their state from `before` exactly; attention entries are kept as written."""

        def keep(entry, old):
            if not isinstance(entry, DeltaNetState):
                return entry
            return jax.vmap(lambda states, prior: states.at(accepted).keep_where(~active, prior))(entry, old)

        return GroupCache(members=tuple(keep(e, o) for e, o in zip(self.members, before.members, strict=True)))
