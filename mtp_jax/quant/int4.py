"""4-bit weights (`--weights int4`, a GGUF's Q4_1 blocks): values 0..15 packed two to a byte, with a float16 scale
and min per block of 32 consecutive contracting elements (llama.cpp's Q4_1 layout: 5 bits a weight).

`INT4` stores so every weight that declares a `MatmulAxes` but the embeddings and lm_heads, which it stores int8
(one scale per vocabulary entry: they are read as lookups too, and llama.cpp's files keep them 8-bit); a converted
folder holds its packed `values` (uint8: the mark of a packed weight when read back), `scales` and `mins`
(params/stored_weights.py). Multiplied as stored by `blocked_product.quantized_einsum` (the values unpacked first:
compiled for TPU that writes them out, so use int8 or fp8 there); read in place, packed, by the CPU row kernel
(kernels/cpu/cpu_rows.py, native/row_kernels.h; forms "q4_1" and "q4_1_int8_rows" of kernels/cpu/kernel_choice.py),
with float or int8-rounded activations (`int8_activations`). The fixed-tile and routed-expert kernels dequantize
it or leave it to XLA."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from mtp_jax.quant.quantized_array import (
    QuantizedArray,
    WeightFormat,
    block_reduce,
    contracting_blocks,
    expand_blocks,
    pack_nibbles,
)

INT4_BLOCK = 32  # contracting elements per 4-bit block (llama.cpp's Q4_0 / Q4_1)
INT4_LEVELS = 15.0


def quantize_int4(weight: jax.Array, contracting: Sequence[int]) -> QuantizedArray:
    """4-bit values 0..15 with a float16 scale and min per block of INT4_BLOCK consecutive contracting elements
    (the contracting axes flattened, `axis_blocks`): scale = (max - min) / 15, w ~ value * scale + min (the layout of
    llama.cpp's Q4_1, whose blocks this finds again from their dequantized weights). Packed two to a byte along the
    last axis where its size is even."""
    w = weight.astype(jnp.float32)
    blocks = contracting_blocks(w.shape, contracting, INT4_BLOCK)
    mins = block_reduce(w, blocks, jnp.min).astype(jnp.float16)
    high = block_reduce(w, blocks, jnp.max)
    scales = ((high - mins.astype(jnp.float32)) / INT4_LEVELS).astype(jnp.float16)
    step = scales.astype(jnp.float32)
    step = jnp.where(step > 0, step, 1.0)  # a constant block: every value 0
    shifted = (w - expand_blocks(mins.astype(jnp.float32), w.shape)) / expand_blocks(step, w.shape)
    levels = jnp.clip(jnp.round(shifted), 0, INT4_LEVELS).astype(jnp.uint8)
    packed = w.shape[-1] % 2 == 0
    values = pack_nibbles(levels) if packed else levels.astype(jnp.int8)  # uint8 values: packed, and only then
    return QuantizedArray(values, scales, jnp.dtype(weight.dtype), mins, packed)


# `--weights int4`: blocks along the contracting axes only, so none spans a batched axis (`batched` unused).
INT4 = WeightFormat("int4", lambda weight, contracting, batched: quantize_int4(weight, contracting), vocabulary="int8")
