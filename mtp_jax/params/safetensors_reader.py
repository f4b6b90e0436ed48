"""A memory-mapped safetensors reader that validates the file before trusting it.

Format: 8-byte little-endian header length N, N bytes of JSON header {name: {dtype, shape, data_offsets}},
then the data. We map the file once and hand out zero-copy views, so bf16 (which NumPy lacks) comes back as
`ml_dtypes.bfloat16` and a truncated or inconsistent file is named before any tensor is used.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from mtp_jax.runtime.errors import ConversionError

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """One `.safetensors` file, header parsed and checked, data memory-mapped (`copy_on_write`: writable views
    whose writes stay in this process; else read-only)."""

    def __init__(self, path: str, copy_on_write: bool = False):
        self.path = path
        size = os.path.getsize(path)
        name = os.path.basename(path)
        if size < 8:
            raise ConversionError(f"{name}: truncated safetensors file ({size} bytes)")
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ConversionError(f"{name}: truncated or corrupt safetensors header")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ConversionError(f"{name}: corrupt safetensors header (not JSON)") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for tname, info in header.items():
            dtype = DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise ConversionError(f"{name}: tensor {tname} has unsupported dtype {info.get('dtype')}")
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            if end > data_len:
                raise ConversionError(
                    f"{name}: truncated safetensors file (tensor {tname} ends at byte {end}, data has {data_len})"
                )
            if end - start != math.prod(shape) * dtype.itemsize:
                raise ConversionError(f"{name}: tensor {tname} byte size does not match its shape {shape}")
            self._entries[tname] = (dtype, shape, start, end)
        self._map = np.memmap(path, dtype=np.uint8, mode="c" if copy_on_write else "r") if self._entries else None

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self._entries[name]
        raw = self._map[self._data_start + start : self._data_start + end]
        return raw.view(dtype).reshape(shape)
