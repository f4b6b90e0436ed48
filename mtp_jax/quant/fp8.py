"""float8 e4m3 weights (`--weights fp8`, and the format DeepSeek-V3 / GLM-4.5-FP8 / Qwen FP8 checkpoints ship):
float8 values with a float32 scale per block of 128 x 128 as the checkpoints have them, 128 consecutive inputs (the
contracting axes flattened) by 128 consecutive outputs, laid on our axes by `axis_blocks`; a layer or expert axis is
never blocked across. scale = max |w| / 448 per block.

`FP8` stores every weight that declares a `MatmulAxes` but the embeddings and lm_heads (the checkpoints keep them in
bfloat16); a converted folder holds its `values` and `scales` (params/stored_weights.py), as a checkpoint's own fp8
weights are kept under `--weights auto` (conversion/convert.py: `ParamReader.fp8_blocks`). Multiplied as stored by
`blocked_product.quantized_einsum` (TPU, GPU), and read in place by the fixed-tile kernel (kernels/fixed_tiles.py)
and, for routed experts, kernels/routed_kernel.py (its block scales spread over the outputs before the loop:
`loop_weights`). On a CPU, where XLA has no float8 arithmetic, held as bits (`hold_float8_as_bits`) and converted a
layer at a time; the CPU row kernel does not read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.quant.int8 import quantize_blocks
from mtp_jax.quant.quantized_array import QuantizedArray, WeightFormat, axis_blocks

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128


def fp8_blocks(
    shape: Sequence[int], contracting: Sequence[int], batched: Sequence[int], block=(FP8_BLOCK, FP8_BLOCK)
) -> tuple[int, ...]:
    """Per-axis box sizes, for a weight of `shape`, of blocks (outputs, inputs) = `block` over (output axes
    flattened) x (contracting axes flattened), as a checkpoint's [out, in] weight has them; `batched` axes (layers,
    experts) are never blocked across."""
    outputs = [a for a in range(len(shape)) if a not in contracting and a not in batched]
    blocks = [1] * len(shape)
    for axes, size in ((outputs, block[0]), (list(contracting), block[1])):
        for axis, box in zip(axes, axis_blocks([shape[a] for a in axes], size), strict=True):
            blocks[axis] = box
    return tuple(blocks)


def quantize_fp8(weight: jax.Array, contracting: Sequence[int], batched: Sequence[int] = ()) -> QuantizedArray:
    """float8 e4m3 values with a float32 scale per 128 x 128 block (`fp8_blocks`): max |w| over the block / 448."""
    blocks = fp8_blocks(weight.shape, contracting, batched)
    return quantize_blocks(weight, blocks, FP8_MAX, jnp.float8_e4m3fn)


FP8 = WeightFormat("fp8", quantize_fp8, vocabulary=None)  # `--weights fp8`


def hold_float8_as_bits(model):
    """Hold every float8 weight's values as their bits (uint8; `QuantizedArray.bits_of` names the float8 type) in
    place, and return `model`: how decode holds them on a CPU. XLA:CPU has no float8 arithmetic and converts a float8
    parameter to float16 whole, once, before the loop that reads it: a copy twice the size of the weights, made at
    every call. Bits read back as float8 inside the layer are converted one layer's slice at a time (same values)."""
    for _, param in nnx.iter_graph(model):
        value = param.get_value() if isinstance(param, nnx.Param) else None
        if isinstance(value, QuantizedArray) and not value.packed and value.bits_of is None:
            dtype = jnp.dtype(value.values.dtype)
            if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
                bits = jax.lax.bitcast_convert_type(value.values, jnp.uint8)
                param.set_value(dataclasses.replace(value, values=bits, bits_of=dtype))
    return model
