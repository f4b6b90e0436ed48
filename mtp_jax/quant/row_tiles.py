"""Weights stored in the CPU row kernel's tile order (native/row_tiles.h), where its int8-rows product reads them.

A decode step on a CPU reads every weight once. Stored as rows ([K, N]), the four weight rows a vector of integer
products takes lie a row apart, so a read of a column strip jumps a row's bytes at every step and the hardware's
prefetcher keeps up with few such streams: the streamed product of one row read about 12 GB/s where a plain
sequential read runs at 29 (docs/benchmarks-log.md). In tile order each weight is one sequential stream and a quad of
rows one vector load; the kernel's sums, and so every result's bits, are those of the rows.

`tile_for_row_kernel` stores every weight of a model that the kernel's int8-rows product will read in that order, on
load: a weight in blocks multiplying activations rounded to int8 (`mark_int8_activations`), a [K, N] matrix (its
contracting axes, then its column axes, after any stacked-layer axes), N a whole number of tiles; and a tied Q8_0
embedding [V, D] as the tiles of its [D, V] transpose, which then multiplies rounded activations as the lm_head too
(llama.cpp's numerics for it; by float rows it cost a fifth of a plain step, and more for each further row of a
verify block), its rows for the input lookup gathered from the tiles. Everything else
that reads such a weight (XLA's products of a prefill, saving, dequantizing) gets it back in row order
(`QuantizedArray.in_rows`). Only a CPU plan with the row kernel on one device reads the tiles as stored
(`kernels/cpu/cpu_rows.py`), so the model is tiled only there.
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from mtp_jax.quant.int8_activations import in_blocks
from mtp_jax.quant.matmul_axes import MATMUL_KEY, MatmulAxes, param_matmul
from mtp_jax.quant.quantized_array import TILE_BYTES, QuantizedArray, TileAxes, scale_tiles, value_tiles

MAX_PACKED_BLOCK = 32  # contracting elements of a 4-bit block the kernel sums in 16-bit pairs (AVX2), at most


def tile_for_row_kernel(model) -> int:
    """Store every weight of `model` that the row kernel's int8-rows product reads in its tile order
    (`tile_axes_of`), in place; returns how many. A tied embedding (a model without an lm_head of its own) is read
    as the lm_head by int8 rows too, in the tiles of its [D, V] transpose (`tied_embedding_axes`)."""
    tiled = 0
    tied = getattr(model, "lm_head", False) is None
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param) or not isinstance(value := param.get_value(), QuantizedArray):
            continue
        declared = param.get_metadata().get(MATMUL_KEY)
        if declared is None or declared.batched:  # routed experts and other batches of matrices stay as rows
            continue
        axes = tile_axes_of(value, param_matmul(param, "/".join(map(str, path))))
        if axes is None and tied and tuple(map(str, path)) == ("embed",):
            value = dataclasses.replace(value, int8_activations=True)
            axes = tied_embedding_axes(value, declared)
        if axes is not None:
            param.set_value(in_tiles(value, axes))
            tiled += 1
    return tiled


def in_tiles(weight: QuantizedArray, axes: TileAxes) -> QuantizedArray:
    """`weight` (row order) in tile order, its matrix where `axes` says."""
    per_byte = 2 if weight.packed else 1
    order = lambda a: None if a is None else scale_tiles(a, axes, per_byte)
    values = value_tiles(weight.values, axes)
    return dataclasses.replace(weight, values=values, scales=order(weight.scales), mins=order(weight.mins),
                               tile_axes=axes)  # fmt: skip


def tile_axes_of(weight: QuantizedArray, axes: MatmulAxes) -> TileAxes | None:
    """Where the row kernel reads `weight`'s matrix in tile order, or None. It needs a weight whose products round
    activations to int8 (4-bit values, or int8 ones in blocks without mins), its axes (`axes`, over the whole array)
    the batched ones (stacked layers), then the contracting ones, then the columns, not a vocabulary nor read in
    parts; blocks of a multiple of 4 elements along the flattened contracting axes (at most MAX_PACKED_BLOCK for
    4-bit values), a scale per column; rows of whole tiles."""
    if axes.vocabulary or axes.split_reads or weight.tile_axes is not None:
        return None
    if not (weight.int8_activations and in_blocks(weight)) or weight.bits_of is not None:
        return None
    lead, contracting = len(axes.batched), len(axes.contracting)
    columns = weight.ndim - lead - contracting
    if axes.batched != tuple(range(lead)) or axes.contracting != tuple(range(lead, lead + contracting)) or columns < 1:
        return None
    return TileAxes(contracting, columns) if _blocks_fit(weight, lead, contracting) else None


def tied_embedding_axes(weight: QuantizedArray, declared: MatmulAxes) -> TileAxes | None:
    """The tiles of an embedding [V, D] in 8-bit blocks along D (a GGUF's Q8_0), read as a tied lm_head: its [D, V]
    transpose's, V a whole number of tiles; None for any other weight."""
    if not declared.vocabulary or declared.contracting != (1,) or weight.ndim != 2 or weight.packed:
        return None
    if not in_blocks(weight) or weight.bits_of is not None or weight.tile_axes is not None:
        return None
    (v, d), (rows, blocks) = weight.shape, weight.scales.shape
    fits = rows == v and d % blocks == 0 and (d // blocks) % 4 == 0 and v % TILE_BYTES == 0
    return TileAxes(1, 1, columns_first=True) if fits else None


def draft_table_in_tiles(rows) -> QuantizedArray | None:
    """The draft vocabulary's rows [Vd, D] of a tied embedding gathered from its tiles (`CausalLM.draft_head`), in
    the tiles of their [D, Vd] transpose as the embedding's lm_head is (a draft pass then reads them by int8 rows as
    one stream, where as rows it took the transposed kernel); None for rows that do not fit them."""
    if not isinstance(rows, QuantizedArray) or not rows.int8_activations:
        return None
    axes = tied_embedding_axes(rows, MatmulAxes(contracting=(1,), vocabulary=True))
    return None if axes is None else in_tiles(rows, axes)


def _blocks_fit(weight: QuantizedArray, lead: int, contracting: int) -> bool:
    shape, scales = weight.shape, weight.scales.shape
    inner = range(lead, lead + contracting)
    if scales[:lead] != shape[:lead] or scales[lead + contracting :] != shape[lead + contracting :]:
        return False  # a scale per stacked matrix and per column
    if any(scales[a] != shape[a] for a in inner[:-1]) or shape[inner[-1]] % scales[inner[-1]]:
        return False  # blocks along the last contracting axis only: in order along the flattened axes
    block = shape[inner[-1]] // scales[inner[-1]]
    row_bytes = math.prod(weight.values.shape[lead + contracting :])
    fits = block % 4 == 0 and row_bytes % TILE_BYTES == 0
    return fits and (block <= MAX_PACKED_BLOCK or not weight.packed)
