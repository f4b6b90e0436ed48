"""Matmuls over weights stored quantized (blocked_product.quantized_einsum, through dispatch.project): the result of the
einsum over the dequantized weight, without ever forming it, and compiled for TPU a read of the weight at its stored
size (the dequantize-then-matmul form reads and writes it several times over)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtp_jax.kernels.dispatch import project
from mtp_jax.plan import topology
from mtp_jax.plan.hlo_traffic import hbm_bytes
from mtp_jax.quant import formats, quantized_array

# (equation, x's shape, the weight's shape, its contracting axes, its batched axes): the forms the models use
FORMS = [
    ("BTD,DNH->BTNH", (2, 3, 256), (256, 4, 64), (0,), ()),  # q/k/v: an fp8 block spans two heads
    ("BTNH,NHD->BTD", (2, 3, 4, 64), (4, 64, 256), (0, 1), ()),  # o_proj: heads x head dim contract
    ("...D,DF->...F", (5, 384), (384, 256), (0,), ()),  # three blocks along the contracting axis
    ("BTD,DC->BTC", (1, 1, 256), (256, 512), (0,), ()),  # a single row (computed beside a copy)
    ("MD,EDF->MEF", (6, 256), (4, 256, 384), (1,), (0,)),  # routed experts' gate and up
    ("MEF,EFD->MD", (6, 4, 384), (4, 384, 256), (1,), (0,)),  # routed experts' down, summed over experts
]


def dequantized(q: quantized_array.QuantizedArray) -> np.ndarray:
    """values * scales (+ mins) with each scale repeated over its block, written with numpy (apart from quant.py);
    packed 4-bit values: the even index in the low nibble."""
    values = np.asarray(q.values)
    if q.packed:
        values = np.stack([values & 15, values >> 4], axis=-1).reshape(q.shape)

    def spread(a):
        a = np.asarray(a, np.float32)
        for axis, (n, d) in enumerate(zip(a.shape, q.shape, strict=True)):
            a = np.repeat(a, d // n, axis=axis)
        return a

    product = values.astype(np.float32) * spread(q.scales)
    return product if q.mins is None else product + spread(q.mins)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("weights", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("form", FORMS, ids=[f[0] for f in FORMS])
def test_quantized_matmul_equals_the_matmul_of_the_dequantized_weight(form, weights, dtype):
    equation, x_shape, w_shape, contracting, batched = form
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), dtype)
    q = formats.quantize_weight(jnp.asarray(rng.normal(size=w_shape), jnp.float32), weights, contracting, batched)
    assert q.scales.size > 1
    reference = np.einsum(equation, np.asarray(x.astype(jnp.float32)), dequantized(q))
    got = jax.jit(project, static_argnums=(0, 3))(equation, x, q, jnp.float32)
    # the same products summed in another order (float32, over at most 1536 terms)
    np.testing.assert_allclose(np.asarray(got), reference, rtol=0, atol=2e-5 * np.abs(reference).max())


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4", "fp8"])
def test_no_dequantized_weight_is_formed(weights):
    """No multiplication in the traced matmul is as large as the weight: the scales meet the products, not the
    weight (reading the parameter with [...] would: the check can fail)."""
    w = formats.quantize_weight(jnp.ones((512, 1024), jnp.float32), weights, (0,), ())
    x = jnp.ones((8, 512), jnp.bfloat16)

    def multiplications(fn) -> list[int]:
        jaxpr = jax.make_jaxpr(fn)(x, w)
        return [math.prod(e.outvars[0].aval.shape) for e in jaxpr.jaxpr.eqns if e.primitive.name == "mul"]

    size = math.prod(w.shape)
    assert max(multiplications(lambda x, w: project("MD,DF->MF", x, w)), default=0) < size // 8
    assert max(multiplications(lambda x, w: project("MD,DF->MF", x, w.dequantize()))) == size


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.usefixtures("optimized_compiles")  # conftest.py: XLA's fusions, as decoding compiles
@pytest.mark.parametrize("weights", ["int8", "fp8"])  # int4 is read as stored by the CPU kernel only (README)
def test_compiled_for_tpu_the_matmul_reads_the_stored_weight_once(weights):
    """A decode-sized pass (8 rows) over an [8192, 16384] weight (too large for XLA to prefetch it on chip for the
    next call) compiled for one TPU v5p chip moves at most 1.15x the stored weight's bytes. With fp8 blocks, the
    same matmul over the weight read through `[...]` (dequantized first) moves several times more: the check can
    fail. (int8's per-channel scales fuse into the matmul either way.)"""
    device = topology.resolve("v5p:2x2x1").devices[0]
    whole = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    shape = (8192, 16384)
    q = jax.eval_shape(
        lambda w: formats.quantize_weight(w, weights, (0,), ()), jax.ShapeDtypeStruct(shape, jnp.float32)
    )
    q = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), q)
    x = jax.ShapeDtypeStruct((8, shape[0]), jnp.bfloat16, sharding=whole)
    stored = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(q))  # values, scales (and mins)

    def moved(fn) -> float:
        return hbm_bytes(jax.jit(fn).lower(x, q).compile().as_text()) / stored

    assert moved(lambda x, w: project("MD,DF->MF", x, w)) <= 1.15
    if weights == "fp8":
        assert moved(lambda x, w: project("MD,DF->MF", x, w.dequantize())) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4", "fp8"])
def test_each_row_gets_the_same_bits_whatever_the_rows_beside_it(weights):
    """bfloat16 rows through a quantized projection, 1 to 64 at a time: each row's output bit for bit the same (the
    batch-invariance that decoding's invariant mode relies on, tests/ops/test_invariance.py)."""
    rng = np.random.default_rng(1)
    q = formats.quantize_weight(jnp.asarray(rng.normal(size=(384, 512)), jnp.float32), weights, (0,), ())
    rows = jnp.asarray(rng.normal(size=(64, 384)), jnp.bfloat16)
    run = jax.jit(lambda x: project("MD,DF->MF", x, q))
    alone = np.stack([np.asarray(run(rows[i : i + 1]))[0] for i in range(3)])
    for count in (2, 3, 8, 64):
        together, shared = np.asarray(run(rows[:count])), min(count, 3)
        np.testing.assert_array_equal(together[:shared].view(np.uint16), alone[:shared].view(np.uint16))
