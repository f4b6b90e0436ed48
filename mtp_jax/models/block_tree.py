"""A draft tree's verify block as the trunk's layers read it (decode/tree.py builds it).

The block has T entries: entry 0 the root (the row's pending token), every other entry one node below its parent,
parents before children, a node at depth d at position n + d. Attention reads the block through `mask` (each entry
sees itself and its ancestors); a recurrent layer (gated DeltaNet) reads each entry's path from the root (`paths`):
its conv taps and its delta-rule state are those of a chain over that path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def ancestry(parents: jax.Array, depth: int) -> jax.Array:
    """[B, T, T] bool: whether block entry j is entry i or one of its ancestors, for a block whose entry i has the
    parent parents[b, i] (< i; an entry without one names itself) and no path deeper than `depth`."""
    t = parents.shape[-1]
    own = jnp.broadcast_to(jnp.eye(t, dtype=bool), (*parents.shape, t))
    seen = own
    for _ in range(depth):
        seen = own | jnp.take_along_axis(seen, parents[..., None], axis=1)
    return seen


def block_depths(parents: jax.Array, depth: int) -> jax.Array:
    """[B, T] int32: each entry's depth below the block's first (the root, its own parent)."""
    depths = jnp.zeros(parents.shape, jnp.int32)
    is_root = parents == jnp.arange(parents.shape[-1])
    for _ in range(depth):
        depths = jnp.where(is_root, 0, jnp.take_along_axis(depths, parents, axis=1) + 1)
    return depths


@struct.dataclass
class BlockTree:
    """mask [B, T, T] bool: whether entry j is entry i or one of its ancestors. paths [B, T, D+1] int32: the entries
    on entry i's path from the root, by depth (past its own depth: entry i again). depths [B, T] int32."""

    mask: jax.Array
    paths: jax.Array
    depths: jax.Array

    @classmethod
    def of(cls, parents: jax.Array, depth: int) -> BlockTree:
        """The block whose entry i has the parent parents[b, i] ([B, T]; the root names itself), `depth` deep."""
        mask, depths = ancestry(parents, depth), block_depths(parents, depth)
        on_level = depths[:, None, None, :] == jnp.arange(depth + 1)[None, None, :, None]  # [B, 1, D+1, T]
        at_depth = mask[:, :, None, :] & on_level  # [B, T, D+1, T]: entry j is i's ancestor at depth d
        own = jnp.broadcast_to(jnp.arange(parents.shape[-1])[:, None], at_depth.shape[1:3])
        paths = jnp.where(jnp.any(at_depth, axis=-1), jnp.argmax(at_depth, axis=-1), own).astype(jnp.int32)
        return cls(mask=mask, paths=paths, depths=depths)

    @property
    def depth(self) -> int:
        return self.paths.shape[-1] - 1

    @property
    def parents(self) -> jax.Array:
        """[B, T] int32: each entry's parent (the root's: itself)."""
        above = jnp.maximum(self.depths - 1, 0)[..., None]
        return jnp.take_along_axis(self.paths, above, axis=2)[..., 0]

    def conv_taps(self, width: int) -> jax.Array:
        """[B, T, W] int32: for a causal conv of width W over a window of the W-1 inputs before the block then its T
        entries, where each entry's W taps lie (oldest first): the inputs of its path, then the window's state."""
        back = width - 1 - jnp.arange(width)  # [W] how many inputs before the entry each tap reads
        above = self.depths[..., None] - back  # [B, T, W] the tap's depth on the entry's path (< 0: before the block)
        on_path = jnp.take_along_axis(self.paths, jnp.maximum(above, 0), axis=2)  # [B, T, W]
        return (width - 1) + jnp.where(above >= 0, on_path, above)

    def along_paths(self, a: jax.Array) -> jax.Array:
        """a [B, T, ...] -> [B, T, D+1, ...]: each entry's path's values, by depth."""
        b, t, steps = self.paths.shape
        flat = self.paths.reshape(b, t * steps, *(1,) * (a.ndim - 2))
        return jnp.take_along_axis(a, flat, axis=1).reshape(b, t, steps, *a.shape[2:])
