"""A layer's weight read in place from its stack, for the CPU row kernel.

A layer scan hands each layer its parameters sliced out of the stacked ones ([L, ...] -> [...]). Before a custom
call (the CPU row kernel of kernels/cpu/cpu_rows.py) XLA cannot pass a slice at a traced offset as a view: it copies the
layer's weights out of the stack, every layer of every step, a cost that grows with the layers' size (measured:
docs/benchmarks-log.md#layers-read-in-place-from-their-stacks-prefills-through-dequantized-weights-cpu). Where the
kernel will read the weights, a scan instead keeps the matmul weights whole (loop-invariant operands) and hands its
layers a `StackedWeight`: the stack and the layer's index. `dispatch.project` gives both to the kernel, which starts
its read at that layer; every other reader takes the layer's slice (`take`), the same values the scan would have
sliced. A kernel that reads only a layer's routed experts in place (kernels/routed_kernel.py) has only those kept
whole.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.quant.quantized_array import QuantizedArray

EXPERT_STACKS = ("expert_gate", "expert_up", "expert_down")  # models/moe.py's routed experts' parameter names


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


def split_stack(stacked, experts_only: bool = False):
    """stacked parameters (every leaf [L, ...]) -> (the matmul weights, kept whole; the rest, for the scan to
    slice): two trees of the input's structure, None where a leaf went to the other one. `experts_only`: only the
    routed experts' weights kept whole (`EXPERT_STACKS`, for a kernel that reads only those in place)."""

    def kept(path, leaf) -> bool:
        if experts_only:
            return any(getattr(key, "key", None) in EXPERT_STACKS for key in path)
        return _kept_whole(leaf)

    whole = jax.tree_util.tree_map_with_path(lambda p, a: a if kept(p, a) else None, stacked, is_leaf=_is_weight)
    rest = jax.tree_util.tree_map_with_path(lambda p, a: None if kept(p, a) else a, stacked, is_leaf=_is_weight)
    return whole, rest


def stack_split_of(plan) -> tuple[bool, bool]:
    """(whether a layer scan keeps weights whole, whether only the routed experts') under execution `plan`
    (config/execution_plan.py)."""
    if plan.reads_stacks_in_place:
        return True, False
    return plan.reads_expert_stacks_in_place, True


def layer_parameters(whole, sliced, layer: jax.Array):
    """One layer's parameters from `split_stack`'s halves: the scan's slices of the rest, and a StackedWeight for
    each weight kept whole."""
    return jax.tree.map(
        lambda kept, part: part if kept is None else StackedWeight(kept, layer),
        whole,
        sliced,
        is_leaf=lambda a: a is None or _is_weight(a),
    )
