"""Layer weights read in place from their stack by the CPU row kernel (ops/stacked_weights.py), and quantized
weights dequantized first in passes of many rows (rowwise.dequantized_first)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.decode.speculative import compile_generate
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.kernels.dispatch import project
from mtp_jax.ops.rowwise import DEQUANTIZED_ROWS
from mtp_jax.ops.stacked_weights import StackedWeight
from mtp_jax.plan import shapes
from mtp_jax.quant import formats, int4, int8

pytestmark = pytest.mark.skipif(cpu_rows.status() != "ready", reason=f"CPU row kernel: {cpu_rows.status()}")

LAYERS = 3
EQUATIONS = {  # equation: (x's shape, a layer's weight shape, its contracting axes)
    "BTD,DNH->BTNH": ((2, 3, 128), (128, 2, 48), (0,)),
    "BTNH,NHD->BTD": ((2, 3, 2, 32), (2, 32, 96), (0, 1)),
    "EMF,EFD->EMD": ((4, 3, 64), (4, 64, 32), (1,)),  # every expert's rows: G = 4 matrices a layer
}
QUANTIZE = {"int8": int8.quantize_int8, "int4": int4.quantize_int4, "int8 blocks": int8.quantize_int8_blocks}


def _stack(equation, form, seed=0):
    """x and a stack of LAYERS weights, each quantized (or cast) on its own."""
    x_shape, w_shape, contracting = EQUATIONS[equation]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
    layers = [jnp.asarray(rng.normal(size=w_shape) / 8, jnp.float32) for _ in range(LAYERS)]
    if form in QUANTIZE:
        layers = [QUANTIZE[form](w, contracting) for w in layers]
    else:
        layers = [w.astype(form) for w in layers]
    return x, jax.tree.map(lambda *parts: jnp.stack(parts), *layers), layers


@pytest.mark.slow
@pytest.mark.parametrize("equation", EQUATIONS)
@pytest.mark.parametrize("form", [jnp.float32, jnp.bfloat16, *QUANTIZE], ids=str)
def test_a_layer_read_in_place_gets_the_bits_of_its_own_weight(equation, form):
    x, stack, layers = _stack(equation, form)
    in_place = jax.jit(lambda x, stack, layer: cpu_rows.einsum(equation, x, StackedWeight(stack, layer)))
    alone = jax.jit(lambda x, w: cpu_rows.einsum(equation, x, w))
    assert cpu_rows.takes(equation, x, StackedWeight(stack, jnp.int32(0)), invariant=False)
    for layer in range(LAYERS):
        got = in_place(x, stack, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone(x, layers[layer])), err_msg=f"layer {layer}")


def test_a_weight_not_read_in_place_is_taken_from_its_stack():
    """Latent attention's per-head absorption reads its [R, N, H] weight as [N, H, R]: not a view of the stack, so
    the layer is taken out first, and the product is the layer's own (to float32's rounding: XLA's dot may sum in
    another order over the slice than over an array of its own, as on an AVX512 host)."""
    rng = np.random.default_rng(1)
    stack = jnp.asarray(rng.normal(size=(LAYERS, 20, 4, 24)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, 4, 24)), jnp.float32)
    weight = StackedWeight(stack, jnp.int32(1))
    assert not cpu_rows.takes("BTNH,RNH->BTNR", x, weight, invariant=False)
    got = project("BTNH,RNH->BTNR", x, weight, jnp.float32)
    want = project("BTNH,RNH->BTNR", x, stack[1], jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    other = project("BTNH,RNH->BTNR", x, stack[0], jnp.float32)
    assert np.abs(np.asarray(got) - np.asarray(other)).max() > 1.0  # another layer's product is far off


@pytest.mark.slow
def test_its_gradients_are_those_of_the_layers_own_product():
    x, stack, layers = _stack("BTD,DNH->BTNH", jnp.float32)
    loss = lambda x, w: jnp.sum(jnp.sin(cpu_rows.einsum("BTD,DNH->BTNH", x, w)))
    got = jax.grad(loss)(x, StackedWeight(stack, jnp.int32(2)))
    want = jax.grad(loss)(x, layers[2])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _int4_model(family="llama-with-mtp-head"):
    model = mtp_jax.CausalLM(shapes.tiny_family_shape(family), dtype=jnp.float32, rngs=nnx.Rngs(5))
    return formats.quantize_model(model, "int4")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama-with-mtp-head", "qwen3_5"])  # a scan over layers; over hybrid groups
def test_a_scan_over_stacked_layers_copies_no_weight_out_of_its_stack(family):
    """The compiled decode of a 4-bit model slices no layer's packed weight out of its stack (with the slices handed
    to the layers, as before, it did: the check can fail)."""
    model = _int4_model(family)
    ids, lens = jnp.ones((1, 4), jnp.int32), jnp.asarray([4], jnp.int32)
    cfg = mtp_jax.DecodeConfig(num_draft=1, max_new_tokens=4)
    hlo = compile_generate(model, ids, lens, jax.random.key(0), cfg).as_text()
    sliced = [line for line in hlo.splitlines() if "dynamic-slice" in line and "= u8[" in line]
    assert 'custom_call_target="mtp_jax_row_matmul"' in hlo and sliced == []


@pytest.mark.slow
@pytest.mark.parametrize("form", ["int8", "int4"])
def test_a_pass_of_many_rows_multiplies_by_the_dequantized_weight(form):
    """A prefill's product: near the exact one; traced for batch-invariant decoding, with few rows, or for a batch
    of expert matrices, it keeps the stored values in the matmul."""
    rng = np.random.default_rng(2)
    weight = QUANTIZE[form](jnp.asarray(rng.normal(size=(128, 96)) / 8, jnp.float32), (0,))
    x = jnp.asarray(rng.normal(size=(DEQUANTIZED_ROWS + 1, 128)), jnp.float32)
    exact = x @ weight.dequantize()
    np.testing.assert_allclose(np.asarray(project("MD,DF->MF", x, weight)), np.asarray(exact), rtol=1e-5, atol=1e-5)

    def dequantizes(fn, *args, shape=weight.shape) -> bool:  # a multiplication shaped as the whole weight
        jaxpr = jax.make_jaxpr(fn)(*args)
        return any(tuple(e.outvars[0].aval.shape) == shape for e in jaxpr.jaxpr.eqns if e.primitive.name == "mul")

    assert dequantizes(lambda x: project("MD,DF->MF", x, weight), x)
    with traced_plan.tracing(traced_plan.resolve(invariant=True)):
        assert not dequantizes(lambda x: project("MD,DF->MF", x, weight), x)
    assert not dequantizes(lambda x: project("MD,DF->MF", x, weight), x[:DEQUANTIZED_ROWS])
    experts = QUANTIZE[form](jnp.asarray(rng.normal(size=(2, 128, 96)) / 8, jnp.float32), (1,))
    rows = jnp.broadcast_to(x, (2, *x.shape))
    assert not dequantizes(lambda x: project("EMD,EDF->EMF", x, experts), rows, shape=experts.shape)
