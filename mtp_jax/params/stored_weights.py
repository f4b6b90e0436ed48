"""Quantized weights in a converted folder: written as stored (`checkpoints_convert --weights`), restored as stored.

A weight kept quantized (`QuantizedArray`) goes into the orbax checkpoint as arrays under its path,
`values` (int8, float8_e4m3fn, or uint8 holding two 4-bit values each), `scales` (float32 or float16) and, for 4-bit
blocks, `mins`, and into the folder's `quantized.json` as its path with the values' dtype and shape and the scales'
dtype and shape, which is what a restore needs to build its targets. A folder without that file
holds every parameter in its model dtype, as folders always did.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.params.source import read_json_object
from mtp_jax.params.tree import ParamPath
from mtp_jax.quant.formats import stored_format, stored_weight
from mtp_jax.quant.matmul_axes import MatmulAxes
from mtp_jax.quant.quantized_array import QuantizedArray

QUANTIZED_FILE = "quantized.json"  # {"/"-joined path: {"values_dtype": ..., "scales_shape": [...]}}


def stored_param(reader, weights: str, matmul: MatmulAxes | None, dtype, on_tensor=None):
    """The parameter `reader` reads (declaring `matmul`: `causal_lm.model_param_matmuls`) as `weights` stores it: a
    checkpoint's fp8 weight kept as its values and scales ("auto", "fp8"); any other weight a format stores
    (`formats.stored_weight`: "int8", "int4", "fp8") quantized; everything else in the model dtype. NumPy arrays
    either way."""
    if weights in ("auto", "fp8") and reader.fp8_blocks is not None:
        parts = (reader.read(on_tensor, part="values"), reader.read(on_tensor, part="scales"))
        return QuantizedArray(*parts, jnp.dtype(dtype))
    dense = reader.read(on_tensor)
    if stored_format(matmul, weights) is None:
        return dense
    return jax.tree.map(np.asarray, stored_weight(jnp.asarray(dense), weights, matmul))


def split_quantized(params: dict[ParamPath, object]) -> tuple[dict[ParamPath, object], dict]:
    """(params with each quantized weight as {"values", "scales"} arrays, the `quantized.json` manifest)."""
    flat, manifest = {}, {}
    for path, value in params.items():
        if isinstance(value, QuantizedArray):
            value = value.as_stored()
            flat[path] = {"values": value.values, "scales": value.scales}
            flat[path] |= {} if value.mins is None else {"mins": value.mins}
            manifest["/".join(path)] = {
                "values_dtype": value.values.dtype.name,
                "values_shape": list(value.values.shape),
                "scales_dtype": value.scales.dtype.name,
                "scales_shape": list(value.scales.shape),
                "mins": value.mins is not None,
            }
        else:
            flat[path] = value
    return flat, manifest


def write_manifest(folder: str, manifest: dict) -> None:
    if manifest:
        with open(os.path.join(folder, QUANTIZED_FILE), "w") as f:
            json.dump(manifest, f, indent=1)


def read_manifest(folder: str) -> dict:
    """The folder's quantized weights ({} for a folder without any); a broken file is refused in one line."""
    path = os.path.join(folder, QUANTIZED_FILE)
    return read_json_object(path) if os.path.isfile(path) else {}


def quantized_target(spec: jax.ShapeDtypeStruct, entry: dict, sharding_of) -> dict:
    """The restore target of a weight stored quantized: {"values", "scales"[, "mins"]} shapes, dtypes and
    shardings (`sharding_of(shape)`, None for the default device). Folders written before 4-bit weights name
    neither the values' shape nor the scales' dtype: the weight's shape and float32."""
    values, scales = tuple(entry.get("values_shape", spec.shape)), tuple(entry["scales_shape"])
    scales_dtype = jnp.dtype(entry.get("scales_dtype", "float32"))
    target = {
        "values": jax.ShapeDtypeStruct(values, jnp.dtype(entry["values_dtype"]), sharding=sharding_of(values)),
        "scales": jax.ShapeDtypeStruct(scales, scales_dtype, sharding=sharding_of(scales)),
    }
    if entry.get("mins"):
        target["mins"] = jax.ShapeDtypeStruct(scales, scales_dtype, sharding=sharding_of(scales))
    return target


def as_quantized(tree, dtype):
    """A restored parameter tree with each {"values", "scales"[, "mins"]} as a `QuantizedArray` read in `dtype`
    (uint8 values: 4-bit, packed)."""
    if isinstance(tree, dict) and set(tree) in ({"values", "scales"}, {"values", "scales", "mins"}):
        packed = tree["values"].dtype == jnp.uint8
        return QuantizedArray(tree["values"], tree["scales"], dtype, tree.get("mins"), packed)
    if isinstance(tree, dict):
        return {key: as_quantized(value, dtype) for key, value in tree.items()}
    return tree
