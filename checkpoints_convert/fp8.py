"""fp8 e4m3 checkpoints with block scales (DeepSeek-V3's release format), dequantized tensor by tensor.

A quantized weight W [out, in] is stored as `NAME` (float8_e4m3fn) plus `NAME_scale_inv` float32
[ceil(out / b0), ceil(in / b1)] for the block size (b0, b1) of `quantization_config.weight_block_size`:
W[i, j] = fp8[i, j] * scale_inv[i // b0, j // b1] (the last block row and column cover the remainders).
Every other tensor (bf16 embeddings, norms, router, ...) passes through untouched.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from checkpoints_convert.errors import ConversionError
from checkpoints_convert.source import CheckpointSource

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def block_size(hf_config: dict) -> tuple[int, int] | None:
    """The (rows, columns) scale block of a block-fp8 checkpoint, None for an unquantized one; refuses any other
    quantization."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    block = quant.get("weight_block_size")
    supported = (
        quant.get("quant_method") == "fp8"
        and quant.get("fmt", "e4m3") == "e4m3"
        and isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    )
    if not supported:
        raise ConversionError(
            f"quantized checkpoints ({quant}) are not supported (only fp8 e4m3 with a 2-d weight_block_size)"
        )
    return block[0], block[1]


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 W = fp8 weight [out, in] * scale_inv [ceil(out / b0), ceil(in / b1)], blockwise."""
    rows, cols = weight.shape
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * scales[:rows, :cols]


class Fp8BlockSource(CheckpointSource):
    """A checkpoint source whose fp8 weights read as their float32 dequantized values; scale tensors are consumed
    with their weights and not listed."""

    def __init__(self, inner: CheckpointSource, block: tuple[int, int]):
        self.inner, self.block, self.path = inner, block, inner.path
        names = inner.tensor_names()
        self._scales = {n for n in names if n.endswith(SCALE_SUFFIX)}
        present = set(names)
        orphans = sorted(s for s in self._scales if s[: -len(SCALE_SUFFIX)] not in present)
        if orphans:
            raise ConversionError(f"fp8 scales without their weight: {', '.join(orphans[:5])}")
        self._names = [n for n in names if n not in self._scales]

    @property
    def hf_config(self) -> dict:
        return self.inner.hf_config

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def read(self, name: str) -> np.ndarray:
        weight = self.inner.read(name)
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self._scales:
            if weight.dtype in FP8_DTYPES:
                raise ConversionError(f"fp8 tensor {name} has no {scale_name}")
            return weight
        scale_inv = self.inner.read(scale_name)
        expected = tuple(-(-n // b) for n, b in zip(weight.shape, self.block, strict=False))
        if weight.ndim != 2 or scale_inv.shape != expected:
            raise ConversionError(
                f"fp8 scale {scale_name} has shape {scale_inv.shape}; weight {weight.shape} with blocks "
                f"{self.block} needs {expected}"
            )
        return dequantize(weight, scale_inv, self.block)

    def load_tokenizer(self):
        return self.inner.load_tokenizer()
