"""A GGUF weight in Q4_1 or Q8_0 held as the file stores it: its levels, float16 scales and mins moved into our
layout as they are, with no dequantizing and no quantizing again.

A block is 32 consecutive elements along the Hugging Face tensor's last (input) axis; in our layout those are the
contracting axes flattened, cut by `quant.axis_blocks` into per-axis boxes. A transform that reshapes or transposes
the tensor (`Linear`, `Reshape`) moves a block's scale exactly as it moves the block when it is applied to the
scales with every blocked axis divided by its box, where it puts the blocked axis on the contracting ones. Other
transforms are not followed here (the caller quantizes the dequantized values again instead).
"""

from __future__ import annotations

import math

import numpy as np

from mtp_jax.conversion.convert import ParamReader
from mtp_jax.params.transforms import Linear, Reshape
from mtp_jax.quant.int4 import INT4_BLOCK
from mtp_jax.quant.quantized_array import QuantizedArray, axis_blocks


def _follows(transform, contracting: tuple[int, ...], ndim: int) -> bool:
    """Whether `transform` puts the tensor's last axis (its blocks') on our `contracting` axes of `ndim`: the input
    axes of a Linear, the last axis of a same-shape copy."""
    if isinstance(transform, Linear):
        return contracting == tuple(range(transform.num_in))
    return isinstance(transform, Reshape) and not transform.flat and contracting == (ndim - 1,)


def read_stored_blocks(reader: ParamReader, contracting: tuple[int, ...], dtype) -> QuantizedArray | None:
    """The parameter `reader` reads, its every tensor in one GGUF block format, as a QuantizedArray of the file's own
    blocks over the `contracting` axes (4-bit levels packed two to a byte along the last axis where it is even, as
    `quant.quantize_int4` packs them); None where a tensor's transform is not one this follows or its blocks do not
    lie along the contracting axes."""
    boxes = [1] * len(reader.shape)
    for axis, box in zip(contracting, axis_blocks([reader.shape[a] for a in contracting], INT4_BLOCK), strict=True):
        boxes[axis] = box
    if math.prod(boxes) != INT4_BLOCK:
        return None
    reduced = tuple(n // b for n, b in zip(reader.shape, boxes, strict=True))
    levels = scales = mins = None
    for name, target in reader.tensors:
        depth = len(target.index)
        if not _follows(target.transform, tuple(a - depth for a in contracting), len(reader.shape) - depth):
            return None
        stored_levels, stored_scales, stored_mins = reader.source.read_stored_blocks(name)
        if levels is None:
            levels = np.empty(reader.shape, stored_levels.dtype)
            scales = np.empty(reduced, np.float16)
            mins = None if stored_mins is None else np.empty(reduced, np.float16)
        levels[target.index] = target.transform(stored_levels, reader.shape[depth:])
        scales[target.index] = target.transform(stored_scales, reduced[depth:])
        if mins is not None:
            mins[target.index] = target.transform(stored_mins, reduced[depth:])
    if mins is None:  # Q8_0
        return QuantizedArray(levels, scales, np.dtype(dtype))
    packed = levels.shape[-1] % 2 == 0
    values = levels[..., 0::2] | (levels[..., 1::2] << 4) if packed else levels.astype(np.int8)
    return QuantizedArray(values, scales, np.dtype(dtype), mins, packed)
