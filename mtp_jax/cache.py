"""Fixed-shape key/value caches. Rows write at their own positions; rollback is by length (attention masks
every slot past the query's position, so rejected drafts are simply overwritten later)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.config import ModelConfig


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

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def bytes_per_token(self) -> int:
        num_layers, _, _, kv_heads, head_dim = self.k.shape
        return 2 * num_layers * kv_heads * head_dim * self.k.dtype.itemsize
