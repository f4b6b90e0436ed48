"""Activations rounded to int8 before they multiply weights stored in blocks (`--activations int8`), as llama.cpp
multiplies its Q4_1 and Q8_0 blocks: per block of the weight's contracting blocks, one scale each (llama.cpp's Q8_1
rounding)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.quant.matmul_axes import MATMUL_KEY
from mtp_jax.quant.quantized_array import QuantizedArray

INT8_ROW_LEVELS = 127.0  # activations rounded to int8 (`activations_rounded_to_int8`): -127..127


def activations_rounded_to_int8(equation: str, x: jax.Array, weight: QuantizedArray) -> jax.Array:
    """x (float32) rounded to int8 per block of the contracting elements that `weight`'s scales cut (llama.cpp's
    Q8_1): d = max |x| / 127 over the block, q = x / d rounded to the nearest integer (ties to even), returned as
    q * d. The row kernel (native/row_int8.h) rounds the same way and sums the products of q as integers. Its
    gradient is x's own (straight through the rounding, whose own is zero almost everywhere)."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    own = lhs.removeprefix("...")
    lead = x.ndim - len(own)
    x = x.astype(jnp.float32)
    split, inner = list(x.shape[:lead]), []
    for letter, size in zip(own, x.shape[lead:], strict=True):
        if letter in out or letter not in rhs:
            split.append(size)
            continue
        n = weight.scales.shape[rhs.index(letter)]
        split += [n, size // n]
        inner.append(len(split) - 1)
    blocks = x.reshape(split)
    d = jnp.max(jnp.abs(blocks), axis=tuple(inner), keepdims=True) / INT8_ROW_LEVELS
    inverse = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    rounded = (jnp.round(blocks * inverse) * d).reshape(x.shape)
    return jax.lax.stop_gradient(rounded) + (x - jax.lax.stop_gradient(x))  # the value rounded exactly


def in_blocks(weight: QuantizedArray) -> bool:
    """Whether a weight's products can round their activations per block: 4-bit values (always in blocks), or int8
    ones with several scales along a contracting axis (a GGUF's Q8_0, `quantize_int8_blocks`), not one per output
    channel (a whole row's one scale would round the activations coarsely)."""
    if weight.packed:
        return True
    if weight.values.dtype != jnp.int8 or weight.mins is not None:
        return False
    return any(1 < n < d for n, d in zip(weight.scales.shape, weight.shape, strict=True))


def mark_int8_activations(model) -> int:
    """Mark every matmul weight of `model` stored in blocks (`in_blocks`: `--weights int4`, a GGUF's Q4_1 and Q8_0
    blocks) to multiply activations rounded to int8 per block (`activations_rounded_to_int8`), as llama.cpp multiplies
    them, in place; returns how many. Embeddings keep float rows here: read as a tied lm_head, an embedding's [V, D]
    rows by int8 rows were no faster than by float ones; stored in the row kernel's tiles of its [D, V] transpose,
    they are, and `row_tiles.tile_for_row_kernel` marks it there (docs/benchmarks-log.md). A different model
    from the float activations' (logits move by about the weights' own error; measured in docs/benchmarks-log.md,
    "Batch 1 on a new CPU"), but plain and MTP decoding of it agree as ever: each row is rounded by itself."""
    marked = 0
    for _, param in nnx.iter_graph(model):
        value = param.get_value() if isinstance(param, nnx.Param) else None
        matmul = param.get_metadata().get(MATMUL_KEY) if isinstance(param, nnx.Param) else None
        if matmul is not None and matmul.vocabulary and matmul.contracting[-1:] == (1,):
            continue  # an embedding [V, D]
        if isinstance(value, QuantizedArray) and in_blocks(value) and not value.int8_activations:
            param.set_value(dataclasses.replace(value, int8_activations=True))
            marked += 1
    return marked


def has_int8_activations(model) -> bool:
    """Whether any weight of `model` multiplies activations rounded to int8 (`mark_int8_activations`)."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, QuantizedArray))
    return any(isinstance(leaf, QuantizedArray) and leaf.int8_activations for leaf in params)
