"""int8 weights: symmetric, stored as int8 values with float32 scales, one per output channel (`--weights int8`),
or float16 scales per block of 32 contracting elements (a GGUF's Q8_0 blocks, found again from their weights).

`INT8` stores every weight that declares a `MatmulAxes`, the embeddings and lm_heads too (one scale per vocabulary
entry); a converted folder holds its `values` and `scales` (params/stored_weights.py). Multiplied as stored by
`blocked_product.quantized_einsum`; read in place by the CPU row kernel (per-channel and Q8_0 rows, [K, N] and
[N, K]: kernels/cpu/cpu_rows.py, forms "int8" and "q8_0" of kernels/cpu/kernel_choice.py), the fixed-tile kernel
(kernels/fixed_tiles.py) and, for routed experts, kernels/routed_kernel.py."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from mtp_jax.quant.int4 import INT4_BLOCK
from mtp_jax.quant.quantized_array import (
    QuantizedArray,
    WeightFormat,
    block_reduce,
    contracting_blocks,
    expand_blocks,
)

INT8_MAX = 127.0


def quantize_blocks(weight: jax.Array, blocks: Sequence[int], qmax: float, qdtype) -> QuantizedArray:
    """Symmetric quantization with one float32 scale (max |w| over the block / qmax) per block of `blocks` (a size
    dividing each axis; the axis's size: one scale along it)."""
    w = weight.astype(jnp.float32)
    split = [n for d, b in zip(w.shape, blocks, strict=True) for n in (d // b, b)]
    amax = jnp.max(jnp.abs(w.reshape(split)), axis=tuple(range(1, len(split), 2)))  # [d // b for each axis]
    scales = jnp.where(amax > 0, amax / qmax, 1.0)  # an all-zero block: any scale
    scaled = w / expand_blocks(scales, w.shape)
    if jnp.issubdtype(qdtype, jnp.integer):
        scaled = jnp.round(scaled)
    values = jnp.clip(scaled, -qmax, qmax).astype(qdtype)
    return QuantizedArray(values, scales, jnp.dtype(weight.dtype))


def quantize_int8(weight: jax.Array, contracting: Sequence[int]) -> QuantizedArray:
    """Symmetric int8 with one float32 scale per output channel: max |w| over the contracting axes / 127."""
    blocks = [d if axis in contracting else 1 for axis, d in enumerate(weight.shape)]
    return quantize_blocks(weight, blocks, INT8_MAX, jnp.int8)


def quantize_int8_blocks(weight: jax.Array, contracting: Sequence[int]) -> QuantizedArray:
    """int8 values with a float16 scale per block of INT4_BLOCK consecutive contracting elements: scale = max |w| /
    127 (llama.cpp's Q8_0, whose blocks this finds again from their dequantized weights)."""
    w = weight.astype(jnp.float32)
    scales = block_reduce(jnp.abs(w), contracting_blocks(w.shape, contracting, INT4_BLOCK), jnp.max) / INT8_MAX
    scales = scales.astype(jnp.float16)
    step = scales.astype(jnp.float32)
    step = jnp.where(step > 0, step, 1.0)  # an all-zero block
    values = jnp.clip(jnp.round(w / expand_blocks(step, w.shape)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedArray(values, scales, jnp.dtype(weight.dtype))


# `--weights int8`: one scale per output channel, so none spans a batched axis (`batched` unused).
INT8 = WeightFormat("int8", lambda weight, contracting, batched: quantize_int8(weight, contracting), vocabulary="int8")
