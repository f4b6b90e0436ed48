"""Fixed-tile products (mtp_jax/kernels/fixed_tiles.py), the GPU's batch-invariant matmuls, run here in Pallas'
interpreter: the same tiles and masks that Triton compiles on a GPU.

- Each equation the models hand it (projections, the tied lm_head read as stored, attention's chunk products,
  per-expert and per-head batches) agrees with an exact float32 einsum.
- A row's bits do not depend on how many rows share the pass (on this CPU XLA's own float32-out product gives a
  lone row other bits: the comparison can fail).
- An int8 or fp8 weight is read as stored, its scales applied per contracting block (fp8) or per output channel
  (int8), against an exact float32 einsum over the weight dequantized; rows' bits do not depend on the pass either.
- Decoding with the kernels forced on (as on a GPU): greedy MTP equals plain decoding and a lone prompt equals its
  row in a batch of mixed lengths, in bfloat16; the traced program holds the kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.config import execution_plan
from mtp_jax.kernels import dispatch, fixed_tiles, traced_plan
from mtp_jax.kernels.dispatch import project
from mtp_jax.plan import shapes
from mtp_jax.quant import formats, quantized_array
from tests.support.prompts import invariant_greedy

EQUATIONS = {  # equation: (a's shape, b's shape)
    "BTD,DNH->BTNH": ((3, 5, 150), (150, 2, 40)),  # a projection to heads
    "BTNH,NHD->BTD": ((3, 5, 2, 40), (2, 40, 70)),  # the attention output's, two contracting axes
    "...D,VD->...V": ((3, 5, 70), (90, 70)),  # the tied lm_head: the embedding as stored
    "BTKGH,BCKH->BKGTC": ((2, 3, 2, 3, 64), (2, 256, 2, 64)),  # a chunk's attention scores
    "BKGTC,BCKH->BTKGH": ((2, 2, 3, 3, 256), (2, 256, 2, 64)),  # and outputs
    "EMF,EFD->EMD": ((4, 6, 48), (4, 48, 30)),  # every expert's rows
    "BTNH,RNH->BTNR": ((2, 3, 4, 24), (20, 4, 24)),  # latent attention's per-head absorption
}


@pytest.mark.slow
@pytest.mark.parametrize("equation", EQUATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_agrees_with_an_exact_einsum(equation, dtype):
    rng = np.random.default_rng(0)
    a_shape, b_shape = EQUATIONS[equation]
    a, b = (jnp.asarray(rng.normal(size=s), dtype) for s in (a_shape, b_shape))
    got = fixed_tiles.einsum(equation, a, b)
    want = jnp.einsum(equation, a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_a_rows_bits_do_not_depend_on_the_pass():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(40, 576)), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=(576, 200)) / 24, jnp.bfloat16)
    tiles = jax.jit(lambda x: fixed_tiles.einsum("MD,DN->MN", x, weight))
    full = np.asarray(tiles(x))
    for count in (1, 2, 3, 17, 33):
        np.testing.assert_array_equal(np.asarray(tiles(x[:count])), full[:count])
    xla = jax.jit(lambda x: jnp.einsum("MD,DN->MN", x, weight, preferred_element_type=jnp.float32))
    assert not np.array_equal(np.asarray(xla(x[:1])), np.asarray(xla(x))[:1])  # XLA:CPU's one-row kernel


def _tiles_taken() -> bool:
    """Whether the plan traced now gives a product to the fixed tiles."""
    return dispatch.product_implementation("BTD,DF->BTF", jnp.ones((1, 2, 8)), jnp.ones((8, 4))) is (
        fixed_tiles.run_product
    )


def _resolved(invariant: bool):
    return traced_plan.tracing(traced_plan.resolve(invariant=invariant))


def test_planned_only_for_a_batch_invariant_decode_on_a_platform_that_needs_it(monkeypatch):
    for on in (True, False):
        with _resolved(on):
            assert not _tiles_taken()  # this CPU: XLA's float32-out products are already row-invariant
    monkeypatch.setattr(fixed_tiles, "PLATFORMS", ("gpu", "cpu"))
    with _resolved(True) as plan:
        assert plan.products is execution_plan.Products.FIXED_TILES
        assert _tiles_taken()
        with _resolved(False):
            assert not _tiles_taken()
        jaxpr = str(jax.make_jaxpr(lambda x, w: project("BTD,DF->BTF", x, w))(jnp.ones((1, 2, 8)), jnp.ones((8, 4))))
        assert "pallas_call" in jaxpr
    assert not _tiles_taken()


QUANTIZED = {  # equation: (x's shape, the weight's shape, its contracting axes, its batched axes)
    "BTD,DF->BTF": ((3, 5, 256), (256, 192), (0,), ()),
    "BTNH,NHD->BTD": ((3, 5, 2, 128), (2, 128, 192), (0, 1), ()),  # fp8: a block per head
    "EMF,EFD->EMD": ((2, 6, 256), (2, 256, 128), (1,), (0,)),  # experts
    "...D,DF->...F": ((2, 3, 384), (384, 130), (0,), ()),  # fp8: output blocks of 65 (the gcd with 128)
}


def _stored(form, equation, seed=4):
    x_shape, w_shape, contracting, batched = QUANTIZED[equation]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=w_shape) / 16, jnp.float32)
    return x, dataclasses.replace(formats.quantize_weight(weight, form, contracting, batched), dtype=jnp.bfloat16)


def _kernel_operand_dtypes(jaxpr) -> list:
    """The operand dtypes of the first pallas_call in `jaxpr` (searched through nested jaxprs)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return [v.aval.dtype for v in eqn.invars]
        for inner in eqn.params.values():
            inner = getattr(inner, "jaxpr", inner)
            if hasattr(inner, "eqns") and (found := _kernel_operand_dtypes(inner)):
                return found
    return []


@pytest.mark.slow
@pytest.mark.parametrize("equation", QUANTIZED)
@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_a_quantized_weight_is_read_as_stored_and_scaled_in_the_tiles(form, equation, monkeypatch):
    monkeypatch.setattr(fixed_tiles, "PLATFORMS", ("gpu", "cpu"))
    x, weight = _stored(form, equation)
    with _resolved(True):
        got = project(equation, x, weight, jnp.float32)
        jaxpr = jax.make_jaxpr(lambda x, w: project(equation, x, w))(x, weight)
    assert _kernel_operand_dtypes(jaxpr.jaxpr)[1] == weight.values.dtype  # no dequantized copy enters the kernel
    exact = weight.values.astype(jnp.float32) * quantized_array.expand_blocks(weight.scales, weight.shape)
    want = jnp.einsum(equation, x.astype(jnp.float32), exact, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(want)))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_a_rows_bits_with_a_quantized_weight_do_not_depend_on_the_pass(form):
    x, weight = _stored(form, "BTD,DF->BTF")
    tiles = jax.jit(lambda x: fixed_tiles.einsum("MD,DF->MF", x, weight))
    rows = x.reshape(-1, x.shape[-1])  # [15, D]
    full = np.asarray(tiles(rows))
    for count in (1, 2, 7):
        np.testing.assert_array_equal(np.asarray(tiles(rows[:count])), full[:count])


def _generate(model, prompts, num_draft):
    return invariant_greedy(model, prompts, num_draft, max_new_tokens=10)


@pytest.mark.slow
def test_decoding_on_fixed_tiles_is_lossless_and_batch_invariant_in_bfloat16(monkeypatch):
    monkeypatch.setattr(fixed_tiles, "PLATFORMS", ("gpu", "cpu"))
    model = mtp_jax.CausalLM(shapes.tiny(), dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.config.vocab_size, n).astype(np.int32) for n in (5, 11, 8)]
    plain = _generate(model, prompts, 0)
    mtp = _generate(model, prompts, 2)
    for row, tokens in enumerate(plain):
        np.testing.assert_array_equal(mtp[row], tokens)
    np.testing.assert_array_equal(_generate(model, prompts[:1], 0)[0], plain[0])  # the shortest, alone
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=4, invariant=True)
    ids, lens = jnp.ones((1, 5), jnp.int32), jnp.asarray([5], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda: mtp_jax.generate(model, ids, lens, jax.random.key(0), cfg))()
    assert "pallas_call" in str(jaxpr)
