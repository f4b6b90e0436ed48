"""A layer's weight read in place from its stack, for the CPU row kernel.

A layer scan hands each layer its parameters sliced out of the stacked ones ([L, ...] -> [...]). Before a custom
call (the CPU row kernel of models/cpu_rows.py) XLA cannot pass a slice at a traced offset as a view: it copies the
layer's weights out of the stack, every layer of every step (eight 4096 x 4096 4-bit layers, one row: 7.0 ms
sliced, 5.3 ms read in place; docs/benchmarks.md). Where the kernel will read the weights, a scan instead keeps
the matmul weights whole (loop-invariant operands) and hands its layers a `StackedWeight`: the stack and the
layer's index. `rowwise.project` gives both to the kernel, which starts its read at that layer; every other reader
takes the layer's slice (`take`), the same values the scan would have sliced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.quant import QuantizedArray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedWeight:
    """Layer `layer` (int32 []) of `stack` (an array or a QuantizedArray, leading axis L)."""

    stack: jax.Array | QuantizedArray
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def ndim(self) -> int:
        return self.stack.ndim - 1

    @property
    def dtype(self):
        return self.stack.dtype

    def take(self) -> jax.Array | QuantizedArray:
        """The layer's weight, as the scan would have sliced it."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False), self.stack)

    def layer_shapes(self) -> jax.ShapeDtypeStruct | QuantizedArray:
        """The layer's weight as shapes and dtypes (nothing traced)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.stack)

    def __getitem__(self, index):
        return self.take()[index]


def layer_value(weight):
    """`weight` as its layer's array (a StackedWeight taken; anything else as it is)."""
    return weight.take() if isinstance(weight, StackedWeight) else weight


def _is_weight(leaf) -> bool:
    return isinstance(leaf, QuantizedArray)


def _kept_whole(leaf) -> bool:
    """A stacked matmul weight: quantized, or a float array of at least two axes a layer."""
    if isinstance(leaf, QuantizedArray):
        return True
    return leaf.ndim >= 3 and jnp.issubdtype(leaf.dtype, jnp.floating)


def split_stack(stacked):
    """stacked parameters (every leaf [L, ...]) -> (the matmul weights, kept whole; the rest, for the scan to
    slice): two trees of the input's structure, None where a leaf went to the other one."""
    whole = jax.tree.map(lambda a: a if _kept_whole(a) else None, stacked, is_leaf=_is_weight)
    rest = jax.tree.map(lambda a: None if _kept_whole(a) else a, stacked, is_leaf=_is_weight)
    return whole, rest


def layer_parameters(whole, sliced, layer: jax.Array):
    """One layer's parameters from `split_stack`'s halves: the scan's slices of the rest, and a StackedWeight for
    each weight kept whole."""
    return jax.tree.map(
        lambda kept, part: part if kept is None else StackedWeight(kept, layer),
        whole,
        sliced,
        is_leaf=lambda a: a is None or _is_weight(a),
    )
