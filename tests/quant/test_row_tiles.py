"""Weights in the CPU row kernel's tile order (quant/row_tiles.py, native/row_tiles.h).

- The order itself: values and scales permuted as the kernel's header documents it, checked against loops written
  here, and back (`QuantizedArray.in_rows`).
- The kernel reads a weight in tiles to the same bits as the weight in rows (4-bit and Q8_0 blocks, one and two
  contracting axes, a layer read in place from its stack, 1 to 9 rows); a product whose layout the tiles do not fit
  goes to XLA, which reads the weight back in row order.
- Whole models (GQA, latent attention with routed experts, hybrid) tiled as a load tiles them decode the tokens of
  the same model in rows, greedy MTP equal to plain, and save their weights in row order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.kernels import dispatch
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.ops.stacked_weights import StackedWeight
from mtp_jax.quant import formats, int4, int8_activations, row_tiles
from mtp_jax.quant.int8 import quantize_int8_blocks
from mtp_jax.quant.matmul_axes import MatmulAxes
from mtp_jax.quant.quantized_array import (
    QuantizedArray,
    TileAxes,
    scale_tiles,
    take_columns,
    take_quantized_rows,
    take_rows,
    value_tiles,
)
from tests.support.decode_models import MODELS, decode, prompts_for
from tests.support.quant_checks import exact_q8_product

needs_kernel = pytest.mark.skipif(cpu_rows.status() != "ready", reason="the CPU row kernel is not built here")


def looped_value_tiles(rows: np.ndarray) -> np.ndarray:
    """[K, B] bytes in tile order, one byte at a time: tiles of 16 bytes of every row, four rows at a time, byte i of
    row j of the four at 4 i + j."""
    k, b = rows.shape
    out = [rows[q + j, 16 * t + i] for t in range(b // 16) for q in range(0, k, 4) for i in range(16) for j in range(4)]
    return np.array(out, rows.dtype).reshape(k, b)


def looped_scale_tiles(scales: np.ndarray, per_byte: int) -> np.ndarray:
    """[KB, N] scales in tile order: tile after tile, block after block, the even columns' then the odd ones'."""
    kb, n = scales.shape
    columns = 16 * per_byte
    out = [
        scales[b, columns * t + (per_byte * i + h)]
        for t in range(n // columns)
        for b in range(kb)
        for h in range(per_byte)
        for i in range(16)
    ]
    return np.array(out, scales.dtype).reshape(kb, n)


def test_the_tile_order_is_the_documented_one_and_comes_back():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 256, (2, 12, 3, 16), dtype=np.uint8)  # 2 stacked, K = 12, N bytes = 3 x 16
    tiled = np.asarray(value_tiles(jnp.asarray(values), TileAxes(1, 2)))
    for layer in range(2):
        want = looped_value_tiles(values[layer].reshape(12, 48)).reshape(12, 3, 16)
        np.testing.assert_array_equal(tiled[layer], want)
    np.testing.assert_array_equal(np.asarray(value_tiles(jnp.asarray(tiled), TileAxes(1, 2), inverse=True)), values)
    two_axes = rng.integers(0, 256, (4, 8, 32), dtype=np.uint8)  # K = 4 x 8 over two contracting axes
    want = looped_value_tiles(two_axes.reshape(32, 32)).reshape(4, 8, 32)
    np.testing.assert_array_equal(np.asarray(value_tiles(jnp.asarray(two_axes), TileAxes(2, 1))), want)
    embedding = rng.integers(-127, 128, (48, 12), dtype=np.int8)  # [V, D]: the tiles of its [D, V] transpose
    tiled = value_tiles(jnp.asarray(embedding), TileAxes(1, 1, columns_first=True))
    want = looped_value_tiles(embedding.T.view(np.uint8)).view(np.int8).reshape(48, 12)
    np.testing.assert_array_equal(np.asarray(tiled), want)
    back = value_tiles(tiled, TileAxes(1, 1, columns_first=True), inverse=True)
    np.testing.assert_array_equal(np.asarray(back), embedding)
    for per_byte in (1, 2):
        scales = rng.normal(size=(2, 3, 64)).astype(np.float16)  # 2 stacked, KB = 3, N = 64
        tiled = np.asarray(scale_tiles(jnp.asarray(scales), TileAxes(1, 1), per_byte))
        for layer in range(2):
            np.testing.assert_array_equal(tiled[layer], looped_scale_tiles(scales[layer], per_byte))
        back = scale_tiles(jnp.asarray(tiled), TileAxes(1, 1), per_byte, inverse=True)
        np.testing.assert_array_equal(np.asarray(back), scales)


def rounded(weight: QuantizedArray) -> QuantizedArray:
    return dataclasses.replace(weight, int8_activations=True)


WEIGHTS = {  # name: (equation, a weight in rows, its MatmulAxes contracting axes)
    "4-bit [K, N]": ("MK,KN->MN", lambda w: rounded(int4.quantize_int4(w, (0,))), (192, 320), (0,)),
    "Q8_0 [K, N]": ("MK,KN->MN", lambda w: rounded(quantize_int8_blocks(w, (0,))), (192, 320), (0,)),
    "4-bit [N, H, D]": ("MNH,NHD->MD", lambda w: rounded(int4.quantize_int4(w, (0, 1))), (4, 64, 96), (0, 1)),
}


def _tiled(weight: QuantizedArray, contracting: tuple[int, ...]) -> QuantizedArray:
    axes = row_tiles.tile_axes_of(weight, _axes(contracting))
    assert axes is not None
    return row_tiles.in_tiles(weight, axes)


def _axes(contracting: tuple[int, ...]) -> MatmulAxes:
    return MatmulAxes(contracting=contracting)


@needs_kernel
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_the_kernel_reads_tiles_to_the_bits_of_rows(name):
    equation, quantize, shape, contracting = WEIGHTS[name]
    weight = quantize(jax.random.normal(jax.random.key(1), shape, jnp.float32) * 0.05)
    tiled = _tiled(weight, contracting)
    k_shape = shape[: len(contracting)]
    x = jax.random.normal(jax.random.key(2), (9, *k_shape), jnp.float32)
    assert cpu_rows.takes(equation, x, tiled, invariant=True)
    product = jax.jit(lambda x, w: cpu_rows.einsum(equation, x, w))
    for rows in (1, 2, 4, 9):
        np.testing.assert_array_equal(np.asarray(product(x[:rows], tiled)), np.asarray(product(x[:rows], weight)))


@needs_kernel
def test_a_layer_in_tiles_is_read_in_place_from_its_stack():
    layers = [rounded(int4.quantize_int4(jax.random.normal(jax.random.key(s), (64, 96)) * 0.05, (0,))) for s in (3, 4)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    axes = row_tiles.tile_axes_of(stack, dataclasses.replace(_axes((1,)), batched=(0,)))
    tiled = row_tiles.in_tiles(stack, axes)
    x = jax.random.normal(jax.random.key(5), (3, 64))
    for i, layer in enumerate(layers):
        from_tiles = cpu_rows.einsum("MK,KN->MN", x, StackedWeight(tiled, jnp.int32(i)))
        np.testing.assert_array_equal(np.asarray(from_tiles), np.asarray(cpu_rows.einsum("MK,KN->MN", x, layer)))


@needs_kernel
def test_a_tied_embedding_in_tiles_is_the_lm_head_by_int8_rows_and_gives_its_rows():
    """The tied embedding [V, D] (Q8_0 blocks) in the tiles of its [D, V] transpose: the lm_head's product by int8
    rows against the exact reference (each block's integer sums), a row's bits the same in any pass; its rows (the
    input lookup, the draft vocabulary's table) the rows of the weight in row order."""
    w = jax.random.normal(jax.random.key(10), (320, 192), jnp.float32) * 0.05  # V = 320, D = 192
    embedding = rounded(quantize_int8_blocks(w, (1,)))
    declared = MatmulAxes(contracting=(1,), vocabulary=True)
    tiled = row_tiles.in_tiles(embedding, row_tiles.tied_embedding_axes(embedding, declared))
    x = np.asarray(jax.random.normal(jax.random.key(11), (11, 192)), np.float32)
    assert cpu_rows.takes("...D,VD->...V", jnp.asarray(x), tiled, invariant=True)
    product = jax.jit(lambda x, w: cpu_rows.einsum("...D,VD->...V", x, w))
    full = np.asarray(product(jnp.asarray(x), tiled))
    reference = exact_q8_product(x, embedding, transposed=True)
    np.testing.assert_allclose(full, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    for rows in (slice(0, 1), slice(3, 5), slice(4, 11)):
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[rows]), tiled)), full[rows])
    ids = jnp.asarray([[0, 17, 319], [5, 16, 15]])
    np.testing.assert_array_equal(np.asarray(take_rows(tiled, ids)), np.asarray(take_rows(embedding, ids)))
    taken, want = take_quantized_rows(tiled, ids[0]), take_quantized_rows(embedding, ids[0])
    for a, b in zip(jax.tree.leaves(taken), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_kernel
def test_the_draft_vocabulary_is_held_as_one_table_in_tiles():
    """The draft vocabulary's rows of a tied embedding in tiles, held in tiles of their own (`draft_table_in_tiles`,
    as a CPU load holds them): the draft head's product against the exact reference of the rows, each row's bits the
    same in any pass; rows the tiles do not fit (float activations, a vocabulary not of whole tiles) stay unheld."""
    w = jax.random.normal(jax.random.key(12), (320, 192), jnp.float32) * 0.05  # V = 320, D = 192
    embedding = rounded(quantize_int8_blocks(w, (1,)))
    declared = MatmulAxes(contracting=(1,), vocabulary=True)
    tiled = row_tiles.in_tiles(embedding, row_tiles.tied_embedding_axes(embedding, declared))
    ids = jnp.asarray([7, 300, 0, 31] * 8)  # Vd = 32, any order
    rows = take_quantized_rows(tiled, ids)
    table = row_tiles.draft_table_in_tiles(rows)
    assert table is not None and table.tile_axes == TileAxes(1, 1, columns_first=True)
    x = np.asarray(jax.random.normal(jax.random.key(13), (3, 192)), np.float32)
    assert cpu_rows.takes("...D,VD->...V", jnp.asarray(x), table, invariant=False)
    product = jax.jit(lambda x, w: cpu_rows.einsum("...D,VD->...V", x, w))
    got = np.asarray(product(jnp.asarray(x), table))
    reference = exact_q8_product(x, take_quantized_rows(embedding, ids), transposed=True)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[1:2]), table)), got[1:2])
    assert row_tiles.draft_table_in_tiles(dataclasses.replace(rows, int8_activations=False)) is None
    assert row_tiles.draft_table_in_tiles(take_quantized_rows(tiled, ids[:24])) is None


def test_a_product_the_tiles_do_not_fit_reads_the_weight_in_rows():
    weight = rounded(int4.quantize_int4(jax.random.normal(jax.random.key(6), (64, 96)) * 0.05, (0,)))
    tiled = _tiled(weight, (0,))
    x = jax.random.normal(jax.random.key(7), (2, 96))
    assert not cpu_rows.takes("MN,KN->MK", x, tiled, invariant=True)  # contracting over the columns
    np.testing.assert_array_equal(
        np.asarray(dispatch.project("MN,KN->MK", x, tiled)), np.asarray(dispatch.project("MN,KN->MK", x, weight))
    )
    np.testing.assert_array_equal(np.asarray(tiled.dequantize()), np.asarray(weight.dequantize()))
    ids = jnp.asarray([3, 0, 95])  # an lm_head's columns for a draft vocabulary: values and scales in row order
    for a, b in zip(jax.tree.leaves(take_columns(tiled, ids)), jax.tree.leaves(take_columns(weight, ids)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weights_the_kernel_cannot_read_in_tiles_stay_in_rows():
    w = jax.random.normal(jax.random.key(8), (64, 40)) * 0.05  # 40 columns: not whole tiles of 4-bit values
    assert row_tiles.tile_axes_of(rounded(int4.quantize_int4(w, (0,))), _axes((0,))) is None
    assert row_tiles.tile_axes_of(int4.quantize_int4(w, (0,)), _axes((0,))) is None  # float activations
    wide = jax.random.normal(jax.random.key(9), (64, 64)) * 0.05
    vocabulary = dataclasses.replace(_axes((0,)), vocabulary=True)
    assert row_tiles.tile_axes_of(rounded(int4.quantize_int4(wide, (0,))), vocabulary) is None


def _in_rows(model):
    return {
        path: param.get_value().in_rows()
        for path, param in nnx.iter_graph(model)
        if isinstance(param, nnx.Param) and isinstance(param.get_value(), QuantizedArray)
    }


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_in_tiles_decode_the_tokens_of_rows(name):
    rows_model = formats.quantize_model(MODELS[name](), "int4")
    int8_activations.mark_int8_activations(rows_model)
    tiled_model = formats.quantize_model(MODELS[name](), "int4")
    int8_activations.mark_int8_activations(tiled_model)
    assert row_tiles.tile_for_row_kernel(tiled_model) > 0
    stored, before = _in_rows(tiled_model), _in_rows(rows_model)
    for path, weight in before.items():
        assert stored[path].tile_axes is None
        for a, b in zip(jax.tree.leaves(stored[path]), jax.tree.leaves(weight), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompts = prompts_for(rows_model)
    plain = decode(rows_model, prompts, 0)
    for k in (0, 2):
        tiled = decode(tiled_model, prompts, k)
        np.testing.assert_array_equal(tiled.tokens, plain.tokens)
        np.testing.assert_array_equal(tiled.lengths, plain.lengths)
