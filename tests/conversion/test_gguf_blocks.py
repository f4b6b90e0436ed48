"""GGUF Q4_1 / Q8_0 weights held as the file stores them (mtp_jax/conversion/gguf_blocks.py): levels, scales and
mins moved into our layout, checked against quantizing the dequantized weights again (the way they were found
before, independent of the file's bytes) and against gguf-py's dequantization.

- On the default model's GGUF (llama: q/k rows permuted by llama.cpp, stacked layers, a Q8_0 embedding read as the
  tied head) both ways give the same bits.
- A Q4_1 block whose levels do not reach 0 and 15 (llama.cpp's importance-weighted quantizer makes them) is kept as
  stored, where quantizing again would change its values.
- A tensor whose transform the blocks are not followed through is left to the quantizer.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from mtp_jax.conversion import placement
from mtp_jax.conversion.convert import ParamReader, config_of, param_readers
from mtp_jax.conversion.gguf_blocks import read_stored_blocks
from mtp_jax.models.causal_lm import model_param_matmuls
from mtp_jax.params.gguf_file import block_parts
from mtp_jax.params.open_source import open_source
from mtp_jax.params.transforms import Linear, Target, Transposed
from mtp_jax.quant import int4, quantized_array


def _parts(kept: quantized_array.QuantizedArray) -> list:
    return [kept.packed, *(None if a is None else np.asarray(a) for a in (kept.values, kept.scales, kept.mins))]


@pytest.mark.slow
def test_the_default_ggufs_blocks_read_as_stored_equal_those_found_again(smollm2_path):
    source = open_source(smollm2_path)
    cfg = config_of(source)
    readers, _ = param_readers(source, cfg, jnp.float32)
    matmuls = model_param_matmuls(cfg, jnp.float32)
    compared = set()
    for path, reader in readers.items():
        shipped = placement._shipped_blocks(source, reader, matmuls.get(path))
        if shipped is None:
            continue
        quantize, contracting = shipped
        stored = read_stored_blocks(reader, contracting, jnp.float32)
        exact = dataclasses.replace(reader, dtype=np.dtype(np.float32))
        again = quantize(jnp.asarray(exact.read()), contracting)
        for got, want in zip(_parts(stored), _parts(again), strict=True):
            if isinstance(want, np.ndarray):
                assert got.dtype == want.dtype and got.shape == want.shape, path
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=str(path))
            else:
                assert got == want, path
        compared.add(path[-1])
    assert compared == {"embed", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


class _OneTensor:
    """A source with one Q4_1 tensor [out, in] whose blocks are given."""

    def __init__(self, blocks: np.ndarray, shape: tuple[int, int]):
        self.blocks, self.hf_shape = blocks, shape

    def read_stored_blocks(self, name):
        return block_parts(self.blocks, GGMLQuantizationType.Q4_1, self.hf_shape)


def _reader(source, shape, transform) -> ParamReader:
    return ParamReader(source, shape, np.dtype(np.float32), (("w", Target(("w",), (), transform)),))


def test_blocks_that_quantizing_again_would_change_are_kept_as_stored():
    rng = np.random.default_rng(0)
    out, inner = 24, 128
    blocks = gguf_quantize(rng.normal(size=(out, inner)).astype(np.float32), GGMLQuantizationType.Q4_1)
    body = blocks.reshape(-1, 20)
    body[:, 4:] = np.minimum(body[:, 4:] & 15, 14) | (np.minimum(body[:, 4:] >> 4, 14) << 4)  # no level reaches 15
    shipped = gguf_dequantize(blocks, GGMLQuantizationType.Q4_1)  # [out, in]
    kept = read_stored_blocks(_reader(_OneTensor(blocks, (out, inner)), (inner, out), Linear()), (0,), jnp.float32)
    assert kept.packed and kept.scales.shape == (inner // 32, out)
    np.testing.assert_array_equal(np.asarray(kept.dequantize()), shipped.T)
    again = int4.quantize_int4(jnp.asarray(shipped.T), (0,))
    assert not np.array_equal(np.asarray(again.dequantize()), shipped.T)


def test_a_transform_the_blocks_are_not_followed_through_is_left_to_the_quantizer():
    blocks = gguf_quantize(np.ones((64, 64), np.float32), GGMLQuantizationType.Q4_1)
    source = _OneTensor(blocks, (64, 64))
    assert read_stored_blocks(_reader(source, (64, 64), Linear()), (0,), jnp.float32) is not None
    assert read_stored_blocks(_reader(source, (64, 64), Transposed((1, 0))), (0,), jnp.float32) is None
    assert read_stored_blocks(_reader(source, (64, 64), Linear()), (1,), jnp.float32) is None  # blocks not on K
