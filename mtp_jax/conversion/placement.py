"""A checkpoint source's parameters read onto devices: whole on the default device, or block by block straight into
their shardings (each process reading only what its devices hold), fp8 weights kept as stored or dequantized."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config.model import ModelConfig
from mtp_jax.conversion.convert import param_readers
from mtp_jax.conversion.gguf_blocks import read_stored_blocks
from mtp_jax.models.causal_lm import model_param_axes, model_param_matmuls
from mtp_jax.parallel.sharding import ShardingRules, place
from mtp_jax.quant.formats import SHIPPED_BLOCKS, stored_format
from mtp_jax.quant.matmul_axes import MatmulAxes
from mtp_jax.quant.quantized_array import QuantizedArray


def read_params(
    source,
    cfg: ModelConfig,
    dtype,
    rules: ShardingRules | None,
    only_mtp: bool = False,
    keep_fp8: bool = False,
    keep_blocks: bool = False,
) -> dict:
    """Every parameter of a checkpoint source, by path, one at a time: on the default device without `rules`;
    with them, each process reads only the blocks its devices hold and places them straight into their sharding.
    `keep_fp8`: weights the checkpoint stores as fp8 with block scales stay so (`QuantizedArray`: the values and
    their scales, each laid out as the weight), else they are dequantized into `dtype`. `keep_blocks`: matmul
    weights, embeddings and lm_heads a GGUF stores in a block format `quant.SHIPPED_BLOCKS` holds (Q4_1, Q8_0) stay
    in it: the file's blocks moved into our layout as stored (`gguf_blocks`), or, for a layout they are not
    followed through, found again by quantizing the values read in float32."""
    readers, _ = param_readers(source, cfg, dtype, only_mtp)
    layouts = model_param_axes(cfg, dtype)  # values and scales of a quantized weight laid out as the weight
    matmuls = model_param_matmuls(cfg, dtype)

    def read(path, reader, part):
        shape = reader.part_shape(part)
        if rules is None:
            return jnp.asarray(reader.read(part=part))
        return place(shape, rules.sharding(layouts[path], shape), functools.partial(reader.read_blocks, part=part))

    params = {}
    for path, reader in readers.items():
        shipped = _shipped_blocks(source, reader, matmuls.get(path)) if keep_blocks else None
        if keep_fp8 and reader.fp8_blocks is not None:
            params[path] = QuantizedArray(read(path, reader, "values"), read(path, reader, "scales"), jnp.dtype(dtype))
        elif shipped is not None:
            quantize, contracting = shipped
            kept = read_stored_blocks(reader, contracting, dtype)
            if kept is None:  # a layout the blocks are not followed through: found again from the values
                exact = dataclasses.replace(reader, dtype=np.dtype(np.float32))  # the file's values, unrounded
                kept = dataclasses.replace(quantize(jnp.asarray(exact.read()), contracting), dtype=jnp.dtype(dtype))
            kept = jax.tree.map(jnp.asarray, kept)
            place_leaf = lambda leaf, path=path: jax.device_put(leaf, rules.sharding(layouts[path], leaf.shape))
            params[path] = kept if rules is None else jax.tree.map(place_leaf, kept)
        else:
            params[path] = read(path, reader, "dense")
    return params


def _shipped_blocks(source, reader, matmul: MatmulAxes | None):
    """(quantizer, contracting axes) that hold the parameter `reader` reads, declaring `matmul`, as the GGUF `source`
    stores it, or None: a weight int8 would store (a matmul weight, embedding or lm_head) whose every tensor is in one
    block format of `quant.SHIPPED_BLOCKS`."""
    block_format = getattr(source, "block_format", None)
    if block_format is None or stored_format(matmul, "int8") is None:
        return None
    formats = {block_format(name) for name, _ in reader.tensors}
    if len(formats) != 1 or None in formats:
        return None
    return SHIPPED_BLOCKS[formats.pop()], matmul.contracting
