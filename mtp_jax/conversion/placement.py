"""A checkpoint source's parameters read onto devices: whole on the default device, or block by block straight into
their shardings (each process reading only what its devices hold), fp8 weights kept as stored or dequantized."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from mtp_jax.config import ModelConfig
from mtp_jax.conversion.convert import param_readers
from mtp_jax.models.causal_lm import model_param_axes
from mtp_jax.quant import QuantizedArray
from mtp_jax.sharding import ShardingRules, place


def read_params(
    source, cfg: ModelConfig, dtype, rules: ShardingRules | None, only_mtp: bool = False, keep_fp8: bool = False
) -> dict:
    """Every parameter of a checkpoint source, by path, one at a time: on the default device without `rules`;
    with them, each process reads only the blocks its devices hold and places them straight into their sharding.
    `keep_fp8`: weights the checkpoint stores as fp8 with block scales stay so (`QuantizedArray`: the values and
    their scales, each laid out as the weight), else they are dequantized into `dtype`."""
    readers, _ = param_readers(source, cfg, dtype, only_mtp)
    layouts = model_param_axes(cfg, dtype)  # values and scales of a quantized weight laid out as the weight

    def read(path, reader, part):
        shape = reader.part_shape(part)
        if rules is None:
            return jnp.asarray(reader.read(part=part))
        return place(shape, rules.sharding(layouts[path], shape), functools.partial(reader.read_blocks, part=part))

    params = {}
    for path, reader in readers.items():
        if keep_fp8 and reader.fp8_blocks is not None:
            params[path] = QuantizedArray(read(path, reader, "values"), read(path, reader, "scales"), jnp.dtype(dtype))
        else:
            params[path] = read(path, reader, "dense")
    return params
