"""Quantized weights as the decode loop reads them: scales spread over the output axes once, before the loop, and
held behind an optimization barrier (so XLA neither recomputes them at every step nor re-lays the values)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
from flax import nnx

from mtp_jax.parallel.sharding import active_platform
from mtp_jax.quant.blocked_product import spread_blocks
from mtp_jax.quant.matmul_axes import MatmulAxes, param_matmul
from mtp_jax.quant.quantized_array import QuantizedArray


def prepare_for_loop(model):
    """Every quantized weight of `model` as the decode loop reads it (`loop_weight`; its values behind the barrier
    too on TPU), in place, and return `model`: traced inside jit before the loop (`speculative.round_step`), once
    per call."""
    whole = active_platform() == "tpu"
    for path, param in list(nnx.iter_graph(model)):
        value = param.get_value() if isinstance(param, nnx.Param) else None
        if isinstance(value, QuantizedArray):
            shape = spread_scales_shape(value, param_matmul(param, "/".join(str(p) for p in path)))
            param.set_value(loop_weight(value, shape, whole))
    return model


def loop_weight(weight: QuantizedArray, spread_shape: Sequence[int], whole: bool = True) -> QuantizedArray:
    """`weight` as a decode loop reads it: its scales spread to `spread_shape` (`spread_output_scales`) behind an
    optimization barrier, which XLA neither sinks back into the loop nor looks through; with `whole`, its values
    behind it too. Compiled for TPU, both save bytes at every step (DeepSeek-V3's fp8 round, measured in
    docs/benchmarks-log.md, "fp8 on TPU at full depth"):
      - block scales spread inside each round were written out and read back at every step (XLA does not hoist
        them out of the loop); spread once, they cost 4 / 128 of the float8 bytes to hold and that much to read;
      - a weight the loop's products read in another layout than its parameter's (float8 weights whose width is
        not a multiple of 128, such as latent attention's [7168, 576] kv_a) was copied into it at every step; the
        barrier's output is the loop's to lay out, so XLA copies such a weight once, before the loop. That copy is
        held beside the weight; where a GPU's products would want most weights in another layout it could double
        them, so `prepare_for_loop` asks for it on TPU only (not measured on a GPU)."""
    spread = spread_output_scales(weight, spread_shape) if tuple(spread_shape) != weight.scales.shape else weight
    if whole:
        return jax.lax.optimization_barrier(spread)
    if spread is weight:
        return weight
    return dataclasses.replace(spread, scales=jax.lax.optimization_barrier(spread.scales))


def spread_scales_shape(weight: QuantizedArray, matmul: MatmulAxes | None) -> tuple[int, ...]:
    """The shape of `weight`'s scales (a weight declaring `matmul`, over its whole array: `param_matmul`) spread over
    its output axes: each axis the matmul neither contracts nor batches, cut into blocks, takes the weight's size
    (one scale along the whole axis stays one). As they are for 4-bit packed values, a weight read in parts
    (`split_reads`), an embedding or lm_head (`vocabulary`: also read a row or column at a time) or one that declares
    no matmul. Only float8 weights have blocks along an output axis."""
    if matmul is None or matmul.vocabulary or matmul.split_reads or weight.packed:
        return weight.scales.shape
    fixed = set(matmul.contracting) | set(matmul.batched)
    sizes = zip(weight.scales.shape, weight.shape, strict=True)
    return tuple(n if axis in fixed or n == 1 else d for axis, (n, d) in enumerate(sizes))


def spread_output_scales(weight: QuantizedArray, shape: Sequence[int]) -> QuantizedArray:
    """`weight` with its scales spread to `shape` (`spread_scales_shape`): the same products, bit for bit, the
    scales multiplying the partial products as they lie."""
    scales = functools.reduce(lambda s, axis: spread_blocks(s, axis, shape[axis]), range(len(shape)), weight.scales)
    return dataclasses.replace(weight, scales=scales)
