"""The CPU's row kernel (mtp_jax/kernels/cpu/cpu_rows.py, native/row_matmul.cc), built on first use with g++.

- Every equation the models hand `dispatch.project` (projections to heads, two contracting axes, the tied lm_head
  read as the embedding, per-expert and per-head batches), with float32, bfloat16, int8 and 4-bit (blocks with
  float16 scales and mins, packed two to a byte) weights and float32 or bfloat16 activations, against an exact
  float32 einsum; an int8 weight enters as stored.
- A row's bits do not depend on how many rows share the pass (1 to 9 and 17: every remainder of the kernel's groups
  of 8 rows), where XLA:CPU's own one-row product gives other bits (so the comparison can fail).
- Which products take it; without a compiler everything stays XLA's and a lone prompt decodes beside its twin.
- Decoding in bfloat16 under batch-invariant numerics with it: greedy MTP equals plain and a lone prompt (no twin)
  equals its row in a batch of mixed lengths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.decode import speculative
from mtp_jax.kernels.cpu import cpu_rows, kernel_build
from mtp_jax.kernels.dispatch import lone_rows_exact, project
from mtp_jax.ops import matmul_layout
from mtp_jax.plan import shapes
from mtp_jax.quant import fp8, int4, int8, quantized_array
from tests.support.prompts import invariant_greedy

pytestmark = pytest.mark.skipif(cpu_rows.status() != "ready", reason=f"CPU row kernel: {cpu_rows.status()}")

EQUATIONS = {  # equation: (x's shape, the weight's shape, its contracting axes)
    "BTD,DNH->BTNH": ((3, 5, 150), (150, 2, 40), (0,)),
    "BTNH,NHD->BTD": ((3, 5, 2, 40), (2, 40, 70), (0, 1)),
    "...D,VD->...V": ((3, 5, 64), (90, 64), (1,)),  # the tied lm_head: the embedding as stored
    "EMF,EFD->EMD": ((4, 6, 48), (4, 48, 30), (1,)),  # every expert's rows
    "BTNH,RNH->BTNR": ((2, 3, 4, 24), (20, 4, 24), (2,)),  # latent attention's per-head absorption
}


def _operands(equation, x_dtype, weight_form, seed=0):
    x_shape, w_shape, contracting = EQUATIONS[equation]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=x_shape), x_dtype)
    weight = jnp.asarray(rng.normal(size=w_shape) / 8, jnp.float32)
    if weight_form == "int8":
        return x, dataclasses.replace(int8.quantize_int8(weight, contracting), dtype=x_dtype)
    if weight_form == "int4":
        return x, dataclasses.replace(int4.quantize_int4(weight, contracting), dtype=x_dtype)
    return x, weight.astype(weight_form)


FORMS = [jnp.float32, jnp.bfloat16, "int8", "int4"]
FORM_IDS = ["float32", "bfloat16", "int8", "int4"]


@pytest.mark.slow
@pytest.mark.parametrize("equation", EQUATIONS)
@pytest.mark.parametrize("weight_form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=["x32", "x16"])
def test_agrees_with_an_exact_einsum(equation, weight_form, x_dtype):
    x, weight = _operands(equation, x_dtype, weight_form)
    in_place = matmul_layout.reads_in_place(matmul_layout.layout(equation, x.shape, weight.shape))
    # packed 4-bit values are only read in place (the per-head absorption's weight is not: XLA's product)
    assert cpu_rows.takes(equation, x, weight, invariant=False) == (weight_form != "int4" or in_place)
    if weight_form == "int4" and not in_place:
        got = project(equation, x, weight, jnp.float32)
    else:
        got = cpu_rows.einsum(equation, x, weight)
    if weight_form in ("int8", "int4"):  # the stored values times their scales (plus the mins), in float32
        dense = weight.levels().astype(jnp.float32) * quantized_array.expand_blocks(weight.scales, weight.shape)
        dense = dense if weight.mins is None else dense + quantized_array.expand_blocks(weight.mins, weight.shape)
    else:
        dense = weight.astype(jnp.float32)
    want = jnp.einsum(equation, x.astype(jnp.float32), dense, precision="highest")
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_int8_weight_enters_as_stored():
    x, weight = _operands("BTD,DNH->BTNH", jnp.bfloat16, "int8")
    jaxpr = str(jax.make_jaxpr(lambda x, w: project("BTD,DNH->BTNH", x, w))(x, weight))
    assert "ffi_call" in jaxpr and "i8[1,150,80]" in jaxpr  # the values as stored, no dequantized copy
    x, weight = _operands("BTD,DNH->BTNH", jnp.bfloat16, "int4")  # blocks of 2 (150 = 75 x 2) along D
    jaxpr = str(jax.make_jaxpr(lambda x, w: project("BTD,DNH->BTNH", x, w))(x, weight))
    assert "u8[1,150,40]" in jaxpr and "f16[1,75,80]" in jaxpr  # two values a byte; float16 scales and mins


@pytest.mark.slow
@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("weight_form", FORMS, ids=FORM_IDS)
def test_a_rows_bits_do_not_depend_on_the_pass(transposed, weight_form):
    rng = np.random.default_rng(1)
    k = 192 if weight_form == "int4" else 200  # 4-bit: six blocks of 32; else a partial vector at the end
    x = jnp.asarray(rng.normal(size=(17, k)), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=(300, k) if transposed else (k, 300)) / 16, jnp.float32)
    quantize = {"int8": int8.quantize_int8, "int4": int4.quantize_int4}.get(weight_form)
    weight = quantize(weight, (1,) if transposed else (0,)) if quantize else weight.astype(weight_form)
    assert cpu_rows.takes("MD,ND->MN" if transposed else "MD,DN->MN", x, weight, invariant=True)
    equation = "MD,ND->MN" if transposed else "MD,DN->MN"
    kernel = jax.jit(lambda x: cpu_rows.einsum(equation, x, weight))
    alone = np.stack([np.asarray(kernel(x[i : i + 1]))[0] for i in range(17)])
    for count in (*range(2, 10), 17):  # every remainder of the kernel's groups of 8 rows, and two whole groups
        np.testing.assert_array_equal(np.asarray(kernel(x[:count])), alone[:count], err_msg=f"{count} rows")
    xla = jax.jit(lambda x: jnp.einsum(equation, x, quantized_array.dense(weight), preferred_element_type=jnp.float32))
    assert not np.array_equal(np.asarray(xla(x[:1])), np.asarray(xla(x))[:1])  # XLA:CPU's one-row kernel


@pytest.mark.slow
def test_which_products_take_it():
    x, weight = _operands("BTD,DNH->BTNH", jnp.bfloat16, jnp.bfloat16)
    long = jnp.ones((2, cpu_rows.ROWS_MAX, 150), jnp.bfloat16)  # a prefill's rows
    assert cpu_rows.takes("BTD,DNH->BTNH", x, weight, invariant=False)
    assert not cpu_rows.takes("BTD,DNH->BTNH", long, weight, invariant=False)  # XLA's GEMM, faster there
    assert cpu_rows.takes("BTD,DNH->BTNH", long, weight, invariant=True)  # every pass: rows alone = rows batched
    fp8_weight = fp8.quantize_fp8(jnp.ones((256, 128), jnp.float32), (0,))  # 128 x 128 blocks: XLA's product
    assert not cpu_rows.takes("BTD,DF->BTF", jnp.ones((1, 1, 256)), fp8_weight, invariant=True)


def test_without_a_compiler_products_stay_xlas_and_a_lone_prompt_has_a_twin(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_rows.reset_status()
    try:
        assert cpu_rows.status().startswith("off (no C++ compiler")
        x, weight = _operands("BTD,DNH->BTNH", jnp.bfloat16, jnp.bfloat16)
        assert not cpu_rows.takes("BTD,DNH->BTNH", x, weight, invariant=True)
        assert not lone_rows_exact()
        assert "ffi_call" not in str(jax.make_jaxpr(lambda x: project("BTD,DNH->BTNH", x, weight))(x))
    finally:
        monkeypatch.delenv("CXX")
        cpu_rows.reset_status()
    assert cpu_rows.status() == "ready" and lone_rows_exact()


def _generate(model, prompts, num_draft):
    return invariant_greedy(model, prompts, num_draft, max_new_tokens=12)


@pytest.mark.slow
def test_invariant_decoding_with_it_is_lossless_and_a_lone_prompt_needs_no_twin():
    model = mtp_jax.CausalLM(shapes.tiny(), dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.config.vocab_size, n).astype(np.int32) for n in (5, 11, 8)]
    cfg = mtp_jax.DecodeConfig(num_draft=2, invariant=True)
    assert not speculative._lone(model, cfg, 1)  # a lone prompt decodes as one row
    plain = _generate(model, prompts, 0)
    mtp = _generate(model, prompts, 2)
    for row, tokens in enumerate(plain):
        np.testing.assert_array_equal(mtp[row], tokens)
    np.testing.assert_array_equal(_generate(model, prompts[:1], 2)[0], plain[0])  # the shortest, alone


@pytest.mark.parametrize("weight_form", [jnp.float32, "int8"], ids=["float32", "int8"])
def test_gradients_through_it_are_xlas(weight_form):
    """Training a head backpropagates through the trunk's projections: the kernel's gradients are XLA's product's."""
    x, weight = _operands("BTD,DNH->BTNH", jnp.float32, weight_form)
    loss = lambda x, w, product: jnp.sum(jnp.sin(product("BTD,DNH->BTNH", x, w)))
    got = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, weight, cpu_rows.einsum)
    want = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, weight, cpu_rows.xla_einsum)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    if weight_form == jnp.float32:
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_damaged_library_in_the_cache_is_built_again(monkeypatch, tmp_path):
    """A build cut short leaves only a scratch file; a library damaged afterwards (here: overwritten) is rebuilt,
    not loaded and not left to turn the kernel off for good."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernel_build, "OPTIMIZE", "-O0")  # quick
    monkeypatch.setattr(kernel_build, "installed_dir", lambda: tmp_path / "no-install")
    path = cpu_rows.build_dir() / kernel_build.library_name("g++")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    cpu_rows.reset_status()
    try:
        assert cpu_rows.status() == "ready"
        assert path.read_bytes()[:4] == b"\x7fELF"
    finally:
        monkeypatch.delenv("XDG_CACHE_HOME")
        cpu_rows.reset_status()
