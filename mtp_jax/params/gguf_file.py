"""A GGUF file's metadata and tensor table, read in one pass over the header, its tensors memory-mapped.

`gguf.GGUFReader` keeps a NumPy view of every part of every metadata value: for a tokenizer's 100,000 strings
that takes seconds on every open. Here a string is a Python string, decoded once, and an array of numbers a list;
the tensors are the same views `GGUFReader` gives (typed for plain types, bytes [..., bytes per row] for the rest).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian files, version 2 and 3).
"""

from __future__ import annotations

import dataclasses
import struct

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types: struct format of the scalars; 8 is a string, 9 an array.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
NUMPY_SCALARS = {code: np.dtype("<" + fmt) if fmt != "?" else np.dtype(np.bool_) for code, fmt in SCALARS.items()}
PLAIN_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}

# Block formats dequantized in one vectorized pass over the whole tensor (the same arithmetic as gguf's, whose
# `dequantize` walks a tensor in small groups of rows: several times slower for these simple formats).
WHOLE_TENSOR = {
    GGMLQuantizationType.Q4_0: gguf.quants.Q4_0,
    GGMLQuantizationType.Q4_1: gguf.quants.Q4_1,
    GGMLQuantizationType.Q5_0: gguf.quants.Q5_0,
    GGMLQuantizationType.Q5_1: gguf.quants.Q5_1,
    GGMLQuantizationType.Q8_0: gguf.quants.Q8_0,
}


def dequantize(data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    """float32 values of a quantized tensor's bytes [..., bytes per row] -> [..., row length]."""
    if tensor_type not in WHOLE_TENSOR:
        return gguf.quants.dequantize(data, tensor_type).astype(np.float32, copy=False)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    blocks = np.asarray(data).reshape(-1, type_size)  # [blocks, bytes per block]
    values = WHOLE_TENSOR[tensor_type].dequantize_blocks(blocks)  # [blocks, block_size]
    return values.astype(np.float32, copy=False).reshape(*data.shape[:-1], data.shape[-1] // type_size * block_size)


def block_parts(data: np.ndarray, tensor_type: GGMLQuantizationType, shape: tuple[int, ...]):
    """A Q4_1 or Q8_0 tensor's bytes as its blocks hold it (w = level * scale + min): levels [*shape] (Q4_1: uint8
    0..15, Q8_0: int8) and, per block along the last axis, the float16 scale and (Q4_1) min [*shape[:-1], blocks],
    else None."""
    block, size = GGML_QUANT_SIZES[tensor_type]
    blocks = np.asarray(data).reshape(-1, size)  # [blocks, bytes]: float16 scale (and min), then the levels
    scales = blocks[:, 0:2].copy().view(np.float16).reshape(*shape[:-1], shape[-1] // block)
    if tensor_type == GGMLQuantizationType.Q8_0:
        return blocks[:, 2:].view(np.int8).reshape(shape), scales, None
    if tensor_type != GGMLQuantizationType.Q4_1:
        raise ValueError(f"{tensor_type.name} blocks are not read as stored")
    packed = blocks[:, 4:]  # byte j: level j (low nibble) and level j + 16 (high nibble)
    levels = np.concatenate([packed & 15, packed >> 4], axis=1).reshape(shape)
    return levels, scales, blocks[:, 2:4].copy().view(np.float16).reshape(scales.shape)


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # plain types: [*reversed(shape)] typed; others: uint8 [*reversed(shape)[:-1], bytes per row]


class GGUFFile:
    """`fields` {key: value} (str, int, float, bool, or a list of them) and `tensors`, in file order. A file that is
    not GGUF, or is cut short, raises ValueError."""

    def __init__(self, path: str):
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._map)
        self._offset = 0
        if bytes(self._buffer[:4]) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._buffer, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (a big-endian file?)")
        self._offset = 4 + struct.calcsize("<IQQ")
        self.fields = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name appears twice")

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._unpack("<Q")
        end = self._offset + size
        if end > len(self._buffer):
            raise ValueError("cut short inside a string")
        text = bytes(self._buffer[self._offset : end]).decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _value(self, kind: int):
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item_kind, count = self._unpack("<I"), self._unpack("<Q")
        if item_kind in NUMPY_SCALARS:
            dtype = NUMPY_SCALARS[item_kind]
            end = self._offset + count * dtype.itemsize
            if end > len(self._buffer):
                raise ValueError("cut short inside an array")
            values = np.frombuffer(self._buffer[self._offset : end], dtype).tolist()
            self._offset = end
            return values
        return [self._value(item_kind) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")

    def _tensor(self, start: int, name: str, dims, tensor_type, offset: int) -> GGUFTensor:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims))
        n_bytes = n_elements * type_size // block_size
        shape = tuple(reversed(dims))
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise ValueError(f"tensor {name} runs past the end of the file")
        if tensor_type in PLAIN_TYPES:
            data = self._map[begin : begin + n_bytes].view(PLAIN_TYPES[tensor_type]).reshape(shape)
        else:
            data = self._map[begin : begin + n_bytes].reshape(quant_shape_to_byte_shape(shape, tensor_type))
        return GGUFTensor(name, tensor_type, dims, n_bytes, begin, data)
