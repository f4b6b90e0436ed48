"""fp8 e4m3 checkpoints with block scales (DeepSeek-V3's release format), dequantized tensor by tensor.

A quantized weight W [out, in] is stored as `NAME` (float8_e4m3fn) plus `NAME_scale_inv` float32
[ceil(out / b0), ceil(in / b1)] for the block size (b0, b1) of `quantization_config.weight_block_size`:
W[i, j] = fp8[i, j] * scale_inv[i // b0, j // b1] (the last block row and column cover the remainders).
Every other tensor (bf16 embeddings, norms, router, ...) passes through untouched.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from mtp_jax.params.source import CheckpointSource
from mtp_jax.runtime.errors import ConversionError

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


@functools.lru_cache(maxsize=64)
def scale_index(
    hf_shape: tuple[int, int], block: tuple[int, int], transform, own_shape: tuple[int, ...], blocks: tuple[int, ...]
) -> np.ndarray:
    """Where each scale of our layout comes from: for a weight stored [out, in] with scale blocks `block`, and laid
    out as ours by `transform` (shape `own_shape`) with per-axis scale blocks `blocks` (mtp_jax.quant.fp8.fp8_blocks),
    the flat index into scale_inv [ceil(out / b0), ceil(in / b1)] of every box, [own_shape[i] // blocks[i]]. Refused
    when a box of ours straddles two checkpoint blocks (a layout the blocks do not follow)."""
    columns = -(-hf_shape[1] // block[1])
    rows, cols = np.arange(hf_shape[0], dtype=np.int32), np.arange(hf_shape[1], dtype=np.int32)
    ids = transform((rows[:, None] // block[0]) * columns + cols[None, :] // block[1], own_shape)  # own_shape
    first = ids[tuple(slice(None, None, b) for b in blocks)]
    expanded = first
    for axis, b in enumerate(blocks):
        expanded = np.repeat(expanded, b, axis=axis)
    if not np.array_equal(expanded, ids):
        raise ConversionError(
            f"fp8 blocks {block} of a {hf_shape} weight do not map onto boxes {blocks} of its {own_shape} layout"
        )
    return first


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
        stored = self.read_quantized(name)
        if stored is None:
            weight = self.inner.read(name)
            if weight.dtype in FP8_DTYPES:
                raise ConversionError(f"fp8 tensor {name} has no {name + SCALE_SUFFIX}")
            return weight
        return dequantize(*stored, self.block)

    def is_quantized(self, name: str) -> bool:
        return name + SCALE_SUFFIX in self._scales

    def read_quantized(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(fp8 weight [out, in], float32 scale_inv [ceil(out / b0), ceil(in / b1)]) as stored, shapes checked;
        None for a tensor stored unquantized."""
        if not self.is_quantized(name):
            return None
        weight, scale_name = self.inner.read(name), name + SCALE_SUFFIX
        scale_inv = self.inner.read(scale_name)
        expected = tuple(-(-n // b) for n, b in zip(weight.shape, self.block, strict=False))
        if weight.ndim != 2 or weight.dtype not in FP8_DTYPES or scale_inv.shape != expected:
            raise ConversionError(
                f"fp8 scale {scale_name} has shape {scale_inv.shape}; weight {weight.shape} ({weight.dtype}) with "
                f"blocks {self.block} needs an fp8 weight and scales {expected}"
            )
        return weight, scale_inv.astype(np.float32)

    def load_tokenizer(self):
        return self.inner.load_tokenizer()
