"""Activations rounded to int8 before each product with a 4-bit weight (`activations="int8"`,
`quant.mark_int8_activations`; llama.cpp's Q4_1 x Q8_1): the CPU row kernel's integer products (native/row_int8.h)
and XLA's path (`quant.activations_rounded_to_int8`) against an exact reference written here with numpy (each block's
products summed as integers), a row's result the same bits in any pass, and greedy MTP equal to plain decoding on the
tiny GQA, latent-attention + experts and hybrid models rounded so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.decode import speculative
from mtp_jax.kernels import dispatch
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.loading import checkpoint
from mtp_jax.ops.stacked_weights import StackedWeight
from mtp_jax.quant import blocked_product, formats, int4, int8_activations, quantized_array
from mtp_jax.quant.int8 import quantize_int8_blocks
from mtp_jax.runtime.errors import UserError
from tests.support.decode_models import MODELS, PROMPT_LENS, decode, prompts_for
from tests.support.quant_checks import exact_q8_product, logits_errors

needs_kernel = pytest.mark.skipif(cpu_rows.status() != "ready", reason="the CPU row kernel is not built here")


def exact_product(x: np.ndarray, weight: quantized_array.QuantizedArray) -> np.ndarray:
    """x [M, K] by a 4-bit weight [K, N] with blocks of 32 along K, x rounded per block as llama.cpp rounds an
    activation (d = max |x| / 127 in float32, q = round(x / d)): each block's products summed exactly as integers,
    then scaled in float64."""
    levels = np.asarray(weight.levels()).astype(np.int64)  # [K, N] 0..15
    scales = np.asarray(weight.scales).astype(np.float64)  # [K / 32, N]
    mins = np.asarray(weight.mins).astype(np.float64)
    out = np.zeros((x.shape[0], levels.shape[1]))
    for b in range(scales.shape[0]):
        block = x[:, 32 * b : 32 * (b + 1)].astype(np.float32)
        d = np.max(np.abs(block), axis=1, keepdims=True) / np.float32(127)
        inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.round(block * inverse).astype(np.int64)  # ties to even, as the kernel's nearbyint
        sums = q @ levels[32 * b : 32 * (b + 1)]  # exact
        out += sums * scales[b] * d + mins[b] * (d * q.sum(axis=1, keepdims=True))
    return out


def rounded_weight(shape, seed: int) -> quantized_array.QuantizedArray:
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.05
    return dataclasses.replace(int4.quantize_int4(w, (0,)), int8_activations=True)


@pytest.mark.slow
def test_rounded_rows_round_each_block_by_its_largest_value():
    x = np.array(jax.random.normal(jax.random.key(1), (3, 64)) * 4, np.float32)
    x[1, 32:] = 0.0  # an all-zero block stays zero
    weight = rounded_weight((64, 32), seed=2)
    rounded = np.asarray(int8_activations.activations_rounded_to_int8("MK,KN->MN", jnp.asarray(x), weight))
    for b in range(2):
        block, got = x[:, 32 * b : 32 * (b + 1)], rounded[:, 32 * b : 32 * (b + 1)]
        d = np.max(np.abs(block), axis=1, keepdims=True) / np.float32(127)
        steps = np.divide(got, d, out=np.zeros_like(got), where=d > 0)
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)  # whole steps of d
        assert np.all(np.abs(steps) <= 127.0001) and np.all(np.abs(got - block) <= d / 2 * 1.0001)
    assert np.all(rounded[1, 32:] == 0)
    gradient = jax.grad(lambda x: jnp.sum(int8_activations.activations_rounded_to_int8("MK,KN->MN", x, weight) * 3.0))(
        jnp.asarray(x)
    )
    np.testing.assert_array_equal(np.asarray(gradient), 3.0)  # straight through the rounding


@pytest.mark.slow
def test_xla_product_matches_the_exact_reference():
    weight = rounded_weight((96, 64), seed=3)
    x = np.asarray(jax.random.normal(jax.random.key(4), (5, 96)), np.float32)
    got = np.asarray(blocked_product.quantized_einsum("MK,KN->MN", jnp.asarray(x), weight))
    np.testing.assert_allclose(got, exact_product(x, weight), rtol=2e-5, atol=2e-5)
    plain_weight = dataclasses.replace(weight, int8_activations=False)
    unrounded = np.asarray(blocked_product.quantized_einsum("MK,KN->MN", jnp.asarray(x), plain_weight))
    assert np.max(np.abs(got - unrounded)) > 1e-4  # the rounding is there: another model of the same weights


def test_every_path_of_a_projection_rounds():
    """A prefill of more than 64 rows multiplies by the weight dequantized first (`rowwise.dequantized_first`): its
    rows are rounded there too, so a prompt's logits come from the same model as its decode steps'."""
    weight = rounded_weight((96, 64), seed=11)
    x = np.asarray(jax.random.normal(jax.random.key(12), (100, 96)), np.float32)
    got = np.asarray(dispatch.project("MK,KN->MN", jnp.asarray(x), weight))
    np.testing.assert_allclose(got, exact_product(x, weight), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (96, 32)])
def test_kernel_matches_the_exact_reference_and_is_row_invariant(shape):
    weight = rounded_weight(shape, seed=5)
    x = np.asarray(jax.random.normal(jax.random.key(6), (11, shape[0])), np.float32)
    product = jax.jit(lambda x, w: cpu_rows.einsum("MK,KN->MN", x, w))
    full = np.asarray(product(jnp.asarray(x), weight))  # a group of 8 rows, then one of 3
    reference = exact_product(x, weight)
    np.testing.assert_allclose(full, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    for rows in (slice(0, 1), slice(3, 5), slice(4, 11), slice(10, 11)):
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[rows]), weight)), full[rows])


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("equation", ["MK,KN->MN", "MK,NK->MN"])
def test_q8_0_by_rounded_rows_matches_the_exact_reference_and_is_row_invariant(equation):
    """Q8_0 blocks (a GGUF's lm_head and the MTP layer held beside a Q4_1 trunk) by int8-rounded rows, in both
    layouts the kernel reads them: each block's products as integers (with AVX512-VNNI, the weights offset by 128 and
    128 sum(q) taken off again)."""
    transposed = equation == "MK,NK->MN"
    w = jax.random.normal(jax.random.key(11), (320, 192) if transposed else (192, 320), jnp.float32) * 0.05
    weight = dataclasses.replace(quantize_int8_blocks(w, (1,) if transposed else (0,)), int8_activations=True)
    x = np.asarray(jax.random.normal(jax.random.key(12), (11, 192)), np.float32)
    product = jax.jit(lambda x, w: cpu_rows.einsum(equation, x, w))
    assert cpu_rows.takes(equation, jnp.asarray(x), weight, invariant=True)
    full = np.asarray(product(jnp.asarray(x), weight))
    reference = exact_q8_product(x, weight, transposed)
    np.testing.assert_allclose(full, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    for rows in (slice(0, 1), slice(3, 5), slice(4, 11), slice(10, 11)):
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[rows]), weight)), full[rows])


@pytest.mark.slow
@needs_kernel
def test_kernel_reads_a_layer_in_place_from_its_stack():
    layers = [rounded_weight((64, 96), seed=s) for s in (7, 8, 9)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = jnp.asarray(jax.random.normal(jax.random.key(10), (2, 64)))
    for i, layer in enumerate(layers):
        alone = cpu_rows.einsum("MK,KN->MN", x, layer)
        from_stack = cpu_rows.einsum("MK,KN->MN", x, StackedWeight(stack, jnp.int32(i)))
        np.testing.assert_array_equal(np.asarray(from_stack), np.asarray(alone))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_rounded_models_decode_mtp_equal_to_plain(name):
    reference = MODELS[name]()
    model = formats.quantize_model(MODELS[name](), "int4")
    assert int8_activations.mark_int8_activations(model) > 0 and int8_activations.has_int8_activations(model)
    prompts = prompts_for(reference)
    errors = logits_errors(reference, model, prompts)
    print(f"{name}: int4 x int8 rows, logits error / std of the float32 logits: mean {errors.mean():.4f}")
    assert 0 < errors.mean() < 0.15 and errors.max() < 1.0
    plain, drafted = decode(model, prompts, 0), decode(model, prompts, 2)
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
    np.testing.assert_array_equal(drafted.lengths, plain.lengths)


def test_rounded_models_always_decode_batch_invariant():
    """A last-bit difference between a verify block's sums and a plain step's can move a rounded activation by a
    whole step: generate traces such a model batch-invariant whatever the config says."""
    model = formats.quantize_model(MODELS["gqa"](), "int4")
    prompts, lens = jnp.asarray(prompts_for(model)), jnp.asarray(PROMPT_LENS)
    cfg = mtp_jax.DecodeConfig(num_draft=2, invariant=False)
    assert not speculative._arguments(model, prompts, lens, jax.random.key(0), cfg, None)[1]["cfg"].invariant
    int8_activations.mark_int8_activations(model)
    assert speculative._arguments(model, prompts, lens, jax.random.key(0), cfg, None)[1]["cfg"].invariant


@pytest.mark.slow
def test_int8_activations_need_4bit_weights():
    model = MODELS["gqa"]()
    with pytest.raises(UserError, match="needs weights in blocks"):
        checkpoint.with_activations(formats.quantize_model(model, "int8"), "int8")
    with pytest.raises(UserError, match="activations must be one of"):
        mtp_jax.load_model(activations="int4")
