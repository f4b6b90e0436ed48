"""Weights stored quantized and dequantized inside the jitted step: int8 weight-only with per-output-channel scales.

Decode reads every weight once per step, so its speed is the bytes it reads. A quantized matmul weight is a
`QuantizedArray`: int8 `values` in the weight's own shape and float32 `scales` broadcast over it (one per output
channel: the contracting axes of the weight's matmul have size 1 in `scales`). It sits in the weight's `nnx.Param`,
and reading it (`param[...]`) gives `values * scales` in the model's dtype, computed inside the jitted program where
XLA fuses it into the matmul's operand (no stored bfloat16 copy). Stacked layers stack both arrays; shardings follow
the weight's logical axes (`sharding.param_axes`), the scales' size-1 axes replicated.

What stays unquantized: embeddings, lm_heads (the MTP layer's own too), norms, biases, routers, the DeltaNet
convolution and decay parameters, and the MTP fusion's small gates. The MTP layer's decoder block is quantized like
the trunk's layers.

    model = quant.quantize_model(model, "int8")   # in place; greedy MTP stays equal to plain on the stored weights
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.sharding import param_axes

WEIGHT_FORMATS = ("auto", "bfloat16", "int8")
INT8_MAX = 127.0

# Contracting axes of each quantized weight, counted over its own axes (without a leading stacked-layer axis), by
# the last component of its path: the scales keep every other axis (one scale per output channel).
CONTRACTING: dict[str, tuple[int, ...]] = {
    "q_proj": (0,), "k_proj": (0,), "v_proj": (0,), "o_proj": (0, 1),  # GQA and gated attention; MLA's q and o
    "gate_proj": (0,), "up_proj": (0,), "down_proj": (0,),  # dense MLP, shared experts, the attention output gate
    "q_a_proj": (0,), "q_b_proj": (0,), "kv_a_proj": (0,), "kv_b_proj": (0,),  # latent attention
    "expert_gate": (1,), "expert_up": (1,), "expert_down": (1,),  # routed experts [E, in, out]
    "in_proj_qkv": (0,), "in_proj_z": (0,), "in_proj_b": (0,), "in_proj_a": (0,), "out_proj": (0, 1),  # DeltaNet
    "proj": (0,),  # the MTP layer's [2D, D] fusion
}  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """values (int8, the weight's shape) times scales (float32, broadcastable to it), read in `dtype`."""

    values: jax.Array
    scales: jax.Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def dequantize(self) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scales).astype(self.dtype)

    def __getitem__(self, index):
        return self.dequantize()[index]


def quantize_int8(weight: jax.Array, contracting: Sequence[int]) -> QuantizedArray:
    """Symmetric int8 with one float32 scale per output channel: max |w| over the contracting axes / 127."""
    w = weight.astype(jnp.float32)
    scales = jnp.max(jnp.abs(w), axis=tuple(contracting), keepdims=True) / INT8_MAX
    scales = jnp.where(scales > 0, scales, 1.0)  # an all-zero channel: any scale
    values = jnp.clip(jnp.round(w / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedArray(values, scales, jnp.dtype(weight.dtype))


def contracting_axes(path: Sequence[str], ndim: int) -> tuple[int, ...] | None:
    """The contracting axes (of the whole array, leading stacked axes included) of the weight at `path` with `ndim`
    dimensions, or None when it stays unquantized."""
    path = tuple(str(p) for p in path)
    own = CONTRACTING.get(path[-1])
    if own is None or (path[0] != "segments" and path[:2] != ("mtp", "block") and path != ("mtp", "proj")):
        return None
    lead = ndim - len([a for a in param_axes(path, ndim) if a != "layers"])
    return tuple(lead + axis for axis in own)


def quantize_model(model, weights: str):
    """Quantize every matmul weight of `model` in place to `weights` ("int8"; "auto" and "bfloat16": as it is) and
    return it; on a mesh, each new array keeps the weight's sharding (values) or its replicated size-1 axes
    (scales)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    if weights in ("auto", "bfloat16"):
        return model
    rules = getattr(model, "sharding_rules", None)
    for path, param in list(nnx.iter_graph(model)):
        if not isinstance(param, nnx.Param) or isinstance(param.get_value(), QuantizedArray):
            continue
        names = [str(p) for p in path]
        axes = contracting_axes(names, param.get_value().ndim)
        if axes is None:
            continue
        quantized = quantize_int8(param.get_value(), axes)
        if rules is not None:
            place = lambda leaf, kind, names=names: jax.device_put(
                leaf, rules.param_sharding([*names, kind], leaf.shape)
            )
            quantized = jax.tree.map(place, quantized, QuantizedArray("values", "scales", quantized.dtype))
        param.set_value(quantized)
    return model


def weight_bytes(model) -> int:
    """Bytes of every parameter of `model` as stored (quantized weights: values and scales)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
