"""A model's parameters as one flat safetensors file, `params.safetensors` in a converted folder (the form the
warm-start cache of the default model takes): restored in a fraction of a second where orbax takes seconds.

Each tensor is named by its parameter path joined with "/", and its data starts on a 64-byte boundary where its
size allows (those that do not go last), so that on CPU the load maps the file and JAX uses the mapped pages in
place, without copying them. The file is a valid safetensors file (contiguous data; the header padded with spaces).
"""

from __future__ import annotations

import json
import os
import struct

import jax
import numpy as np

from mtp_jax.config.model import ModelConfig
from mtp_jax.models.causal_lm import model_param_axes
from mtp_jax.parallel.sharding import ShardingRules, place_host_array
from mtp_jax.params.safetensors_reader import DTYPES, SafetensorsFile
from mtp_jax.params.tree import ParamPath, abstract_params, nest
from mtp_jax.quant.quantized_array import QuantizedArray
from mtp_jax.runtime.errors import ConversionError

STATE_FILE = "params.safetensors"
QUANTIZED_PARTS = ("values", "scales", "mins")
ALIGN = 64  # what XLA's CPU client needs to use a host buffer in place
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_state(path: str, params: dict[ParamPath, np.ndarray]) -> None:
    """Write `params` ({path: host array}) to the safetensors file `path`, aligned as the module says."""
    named = {"/".join(p): np.ascontiguousarray(v) for p, v in params.items()}
    order = sorted(named, key=lambda n: named[n].nbytes % ALIGN != 0)  # aligned sizes first, so they stay aligned
    header, offset = {}, 0
    for name in order:
        value = named[name]
        header[name] = {"dtype": DTYPE_NAMES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + value.nbytes]}  # fmt: skip
        offset += value.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # the data starts on a boundary
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            f.write(memoryview(named[name].reshape(-1).view(np.uint8)))  # any dtype, bfloat16 included
        f.flush()
        os.fsync(f.fileno())


def read_state(path: str, cfg: ModelConfig, dtype, rules: ShardingRules | None) -> dict:
    """The nested parameters of the model for `cfg` from the file at `path`, each checked against the model's
    parameter (every one present, shapes equal, nothing else; cast to its dtype where it differs) and placed on the
    default device (in place, on CPU) or, with `rules`, straight into its sharding. A weight stored quantized is
    `<path>/values`, `<path>/scales` and, for 4-bit blocks, `<path>/mins` (uint8 values: packed 4-bit), read back
    as a `QuantizedArray` in `dtype`."""
    file = SafetensorsFile(path, copy_on_write=True)  # XLA may write into a donated buffer: never into the file
    expected = abstract_params(cfg, dtype)
    names = {"/".join(p): p for p in expected}
    parts = {f"{name}/{part}" for name in names for part in QUANTIZED_PARTS}
    unexpected = sorted(set(file.names()) - set(names) - parts)
    if unexpected:
        raise ConversionError(f"{path}: unexpected tensor {unexpected[0]}")
    layouts = model_param_axes(cfg, dtype)

    def place_value(value, param_path):
        if rules is None:
            return jax.device_put(value)
        return place_host_array(value, rules.sharding(layouts[param_path], value.shape))

    params = {}
    for name, param_path in names.items():
        spec = expected[param_path]
        if f"{name}/values" in file.names():
            params[param_path] = _quantized(file, path, name, spec, lambda v, p=param_path: place_value(v, p))
            continue
        if name not in file.names():
            raise ConversionError(f"{path}: missing tensor {name}")
        value = file.read(name)
        if value.shape != spec.shape:
            raise ConversionError(f"{path}: tensor {name} has shape {value.shape}, the model's {spec.shape}")
        value = value if value.dtype == spec.dtype else value.astype(spec.dtype)  # e.g. float32 kept, bfloat16 asked
        params[param_path] = place_value(value, param_path)
    return nest(params)


def _quantized(file: SafetensorsFile, path: str, name: str, spec, place_value) -> QuantizedArray:
    """The quantized weight `name` of the file at `path`, checked against the model's parameter `spec`."""
    if f"{name}/scales" not in file.names():
        raise ConversionError(f"{path}: missing tensor {name}/scales")
    values, scales = file.read(f"{name}/values"), file.read(f"{name}/scales")
    mins = file.read(f"{name}/mins") if f"{name}/mins" in file.names() else None
    packed = values.dtype == np.uint8
    shape = (*values.shape[:-1], 2 * values.shape[-1]) if packed else values.shape
    if shape != spec.shape or scales.ndim != len(shape) or (mins is not None and mins.shape != scales.shape):
        raise ConversionError(f"{path}: tensor {name} has shape {shape}, the model's {spec.shape}")
    mins = None if mins is None else place_value(mins)
    return QuantizedArray(place_value(values), place_value(scales), spec.dtype, mins, packed)
