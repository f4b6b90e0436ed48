"""Quantized weights prepared once before the decode loop (`quant.prepare_for_loop`): block scales spread over a
weight's outputs give the same products, bit for bit; compiled for TPU, a loop that reads them spread moves about
the stored bytes a step, where spreading them inside every step wrote them out and read them back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mtp_jax
from mtp_jax.plan import shapes, topology
from mtp_jax.plan.hlo_traffic import hbm_bytes
from mtp_jax.quant import blocked_product, formats, fp8, int8, loop_weights, quantized_array


def fp8_weight(shape, contracting, batched=(), seed=0) -> quantized_array.QuantizedArray:
    return fp8.quantize_fp8(jax.random.normal(jax.random.key(seed), shape, jnp.float32), contracting, batched)


# (equation, weight shape, contracting axes, batched axes, block scales' shape, spread scales' shape): 128 x 128
# blocks laid on the weight's axes (`axis_blocks`), then each output axis cut into blocks takes its full size.
CASES = [
    ("MD,EDF->MEF", (3, 384, 256), (1,), (0,), (3, 3, 2), (3, 3, 256)),  # routed experts
    ("BTD,DNH->BTNH", (384, 4, 64), (0,), (), (3, 2, 1), (3, 4, 1)),  # heads of 64: two heads a block
    ("BTNW,NWD->BTD", (4, 64, 384), (0, 1), (), (2, 1, 3), (2, 1, 384)),  # an output projection
]


@pytest.mark.slow
@pytest.mark.parametrize("equation, shape, contracting, batched, blocks, spread", CASES)
def test_spread_scales_multiply_the_same_products(equation, shape, contracting, batched, blocks, spread):
    weight = fp8_weight(shape, contracting, batched)
    assert weight.scales.shape == blocks
    spread_weight = loop_weights.spread_output_scales(weight, spread)
    assert spread_weight.scales.shape == spread
    lhs = equation.split(",")[0]
    sizes = dict(zip(equation.split("->")[0].split(",")[1], shape, strict=True)) | {"M": 5, "B": 2, "T": 3}
    x = jax.random.normal(jax.random.key(1), [sizes[a] for a in lhs], jnp.float32)
    np.testing.assert_array_equal(
        blocked_product.quantized_einsum(equation, x, spread_weight),
        blocked_product.quantized_einsum(equation, x, weight),
    )


@pytest.mark.slow
def test_prepare_for_loop_spreads_only_blocked_output_axes_and_keeps_the_logits():
    """A llama-layout model with hidden 256 in fp8 (two blocks along several outputs): the attention and MLP
    weights' scales spread over their blocked output axes, the contracting ones untouched; the logits bit for bit
    the same; generate (which prepares them before its loop) gives plain decoding's tokens with drafts."""
    cfg = shapes.SHAPES["tiny"]().replace(hidden_size=256, intermediate_size=384, num_heads=4, head_dim=64)
    model = formats.quantize_model(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(0)), "fp8")
    spread = loop_weights.prepare_for_loop(nnx.clone(model))
    changed = []
    for (path, before), (_, after) in zip(nnx.iter_graph(model), nnx.iter_graph(spread), strict=True):
        if isinstance(before, nnx.Param) and isinstance(before.get_value(), quantized_array.QuantizedArray):
            old, new = before.get_value().scales.shape, after.get_value().scales.shape
            weight = before.get_value().shape
            for n, m, d in zip(old, new, weight, strict=True):
                assert m == n or (1 < n < d and m == d), (path, old, new)
            changed += [path] if old != new else []
    assert {str(p[-1]) for p in changed} >= {"q_proj", "gate_proj", "up_proj", "down_proj", "o_proj"}

    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % cfg.vocab_size, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
    logits = []
    for m in (model, spread):
        hidden, _ = m.trunk(tokens, positions, m.new_cache(2, 32), jnp.asarray([12, 7]))
        logits.append(np.asarray(m.logits(hidden)))
    np.testing.assert_array_equal(logits[1], logits[0])

    lens = jnp.asarray([12, 7], jnp.int32)
    runs = [
        mtp_jax.generate(model, tokens, lens, jax.random.key(0), mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=12))
        for k in (0, 2)
    ]
    np.testing.assert_array_equal(np.asarray(runs[1].tokens), np.asarray(runs[0].tokens))


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.usefixtures("optimized_compiles")  # conftest.py: XLA's fusions, as decoding compiles
def test_compiled_for_tpu_a_loop_reads_scales_spread_before_it_at_about_the_stored_bytes():
    """DeepSeek-V3's routed experts on one chip of its v5p plan (32 experts of [7168, 512], float8, 8 rows),
    multiplied 4 times in a loop compiled for TPU v5p: with the scales spread before the loop, each step moves at
    most 1.07x the stored weight (the spread scales are 4 / 128 of it); spread inside each step, XLA writes them
    out and reads them back: more than 1.1x (the check can fail)."""
    device = topology.resolve("v5p:2x2x1").devices[0]
    whole = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    experts, inputs, width, steps = 32, 7168, 512, 4
    abstract = jax.ShapeDtypeStruct((experts, inputs, width), jnp.float32)
    weight = jax.eval_shape(lambda w: fp8.quantize_fp8(w, (1,), (0,)), abstract)
    weight = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), weight)
    x = jax.ShapeDtypeStruct((8, inputs), jnp.bfloat16, sharding=whole)
    stored = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(weight))

    def moved_per_step(spread_first: bool) -> float:
        def loop(x, w):
            if spread_first:
                w = loop_weights.loop_weight(w, (experts, inputs // 128, width))

            def step(_, x):
                y = blocked_product.quantized_einsum("MD,EDF->MEF", x, w)  # [M, E, F]
                return x + jnp.sum(y, axis=(1, 2))[:, None].astype(x.dtype)

            return jax.lax.fori_loop(0, steps, step, x)

        return hbm_bytes(jax.jit(loop).lower(x, weight).compile().as_text()) / (steps * stored)

    assert moved_per_step(True) <= 1.07  # measured 1.059
    assert moved_per_step(False) > 1.1  # measured 1.129


@pytest.mark.slow
def test_block_parts_keep_each_half_as_stored_where_it_is_one_block():
    """Latent attention's kv_b [R, N, I] in fp8 (128 x 128 blocks; I = 128 key + 128 value dims): cut along I into
    its halves, each keeps its float8 values and one scale along I, and its absorbed product equals the product by
    the dequantized half. An int8 kv_b (a scale per output channel) or a cut inside a block is refused."""
    weight = fp8_weight((256, 4, 256), (0,))
    assert weight.scales.shape == (2, 4, 2)
    keys, values = quantized_array.block_parts(weight, 2, (128, 128))
    assert keys.values.dtype == jnp.float8_e4m3fn and keys.scales.shape == values.scales.shape == (2, 4, 1)
    dense = weight.dequantize()
    q = jax.random.normal(jax.random.key(2), (2, 3, 4, 128), jnp.float32)
    np.testing.assert_allclose(
        blocked_product.quantized_einsum("BTNH,RNH->BTNR", q, keys),
        jnp.einsum("BTNH,RNH->BTNR", q, dense[..., :128]),
        rtol=1e-5,
        atol=1e-5,
    )
    latent = jax.random.normal(jax.random.key(3), (2, 3, 4, 256), jnp.float32)
    np.testing.assert_allclose(
        blocked_product.quantized_einsum("BTNR,RNW->BTNW", latent, values),
        jnp.einsum("BTNR,RNW->BTNW", latent, dense[..., 128:]),
        rtol=1e-5,
        atol=1e-5,
    )
    assert quantized_array.block_parts(weight, 2, (64, 192)) is None
    int8_weight = int8.quantize_int8(jax.random.normal(jax.random.key(0), (256, 4, 256)), (0,))
    assert quantized_array.block_parts(int8_weight, 2, (128, 128)) is None
