"""int8 weight-only storage (mtp_jax/quant/int8.py): one byte a weight plus a float32 scale per output channel
(embeddings and lm_heads: per vocabulary entry), dequantized inside the jitted step. Its logits stay close to the
unquantized model's (the error is printed); greedy MTP decoding equals plain greedy decoding of the int8 model, for a
GQA trunk, latent attention with routed experts and a hybrid trunk; the plan's parameter bytes per chip are those of
int8 values and float32 scales."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.decode import adaptive
from mtp_jax.parallel import sharding
from mtp_jax.plan import planning, shapes, topology
from mtp_jax.quant import formats, quantized_array
from tests.support.commands import cpu_env
from tests.support.decode_models import MODELS, decode, prompts_for
from tests.support.quant_checks import contracted_axes, logits_errors


def contracted_size(names: list[str], shape: tuple[int, ...], weights: str = "int8") -> int | None:
    """How many weights each output channel's scale covers (None: not quantized)."""
    axes = contracted_axes(names, weights)
    return None if axes is None else math.prod(shape[a] for a in axes)


def expected_bytes(model) -> int:
    """Bytes of `model`'s parameters once int8: quantized weights 1 byte a value + 4 per output channel."""
    total = 0
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            value = param.get_value()
            contracted = contracted_size([str(p) for p in path], value.shape)
            total += (
                value.size * value.dtype.itemsize if contracted is None else value.size + 4 * value.size // contracted
            )
    return total


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_int8_model_bytes_logits_and_lossless_mtp(name):
    reference = MODELS[name]()
    model = formats.quantize_model(MODELS[name](), "int8")
    assert quantized_array.weight_bytes(model) == expected_bytes(reference)
    assert quantized_array.weight_bytes(model) < 0.6 * quantized_array.weight_bytes(
        reference
    )  # float32 reference: under a third + tables
    prompts = prompts_for(reference)
    errors = logits_errors(reference, model, prompts)
    print(f"{name}: int8 logits, error / std of the float32 logits: mean {errors.mean():.4f}, max {errors.max():.4f}")
    # measured: mean 0.007-0.013, max 0.03-0.23 (0.003-0.006 and 0.013-0.031 with float32 heads: a routing or
    # recurrence amplifies the embedding's error at a few positions)
    assert 0 < errors.mean() < 0.02 and errors.max() < 0.3

    if name == "gqa":  # the same quantized-weight path as the other two; its decode is left to them
        return
    plain, drafted = decode(model, prompts, 0), decode(model, prompts, 2)
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
    np.testing.assert_array_equal(drafted.lengths, plain.lengths)
    assert drafted.stats.accepted_at[0] > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_step_bytes_count_int8_weights_as_stored(name):
    """The parameter bytes a plain step reads (`adaptive.step_param_bytes`, the adaptive policy's round costs):
    the layers, the final norm and the head (a tied embedding), int8 ones at a byte a value plus their scales."""
    reference = MODELS[name]()
    expected = 0
    for path, param in nnx.iter_graph(reference):
        names = [str(p) for p in path] or [""]
        read = names[0] in ("segments", "final_norm", "lm_head") or (names == ["embed"] and reference.lm_head is None)
        if isinstance(param, nnx.Param) and read:
            value, contracted = param.get_value(), contracted_size(names, param.get_value().shape)
            expected += value.nbytes if contracted is None else value.size + 4 * value.size // contracted
    assert adaptive.step_param_bytes(formats.quantize_model(MODELS[name](), "int8"))[0] == expected


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_plan_counts_int8_values_and_scales_per_chip():
    """tiny dense model on v5e:2x2 (model=4): the int8 plan's parameter bytes per chip are the bfloat16 plan's
    with each quantized weight's shard at one byte a value plus its float32 scales' shard."""
    cfg = shapes.SHAPES["tiny"]()
    target = topology.resolve("v5e:2x2")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,model=4", target.devices))
    bf16 = planning.abstract_model(cfg, jnp.bfloat16, rules)
    int8 = planning.abstract_model(cfg, jnp.bfloat16, rules, "int8")
    expected = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.split(bf16)[1]))[0]:
        names = sharding.path_names(path)
        shard = leaf.sharding.shard_shape(leaf.shape)
        if contracted_size(names, leaf.shape) is None:
            expected += math.prod(shard) * 2
            continue
        contracted = contracted_axes(names)
        expected += math.prod(shard) + 4 * math.prod(1 if i in contracted else n for i, n in enumerate(shard))
    assert planning.shard_bytes(nnx.split(int8)[1]) == expected
    assert planning.shard_bytes(nnx.split(int8)[1]) < 0.75 * planning.shard_bytes(nnx.split(bf16)[1])


SHARDED_INT8 = """
import jax, jax.numpy as jnp, numpy as np, json
from flax import nnx
import mtp_jax
from mtp_jax.parallel import sharding
from mtp_jax.quant import formats, quantized_array
from mtp_jax.plan.shapes import SHAPES
cfg = SHAPES["deepseek-v3-tiny"]()
ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 12)), jnp.int32)
lens = jnp.array([12, 5, 9, 3], jnp.int32)
dc = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=16, stop_on_eos=False)
one = formats.quantize_model(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(0)), "int8")
mesh = sharding.make_mesh("data=2,expert=2,model=2")
many = formats.quantize_model(sharding.shard_model(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(0)), mesh), "int8")
quantized = [(path, p.get_value()) for path, p in nnx.iter_graph(many) if isinstance(p, nnx.Param)]
specs = {"/".join(map(str, path)): [list(q.values.sharding.spec), list(q.scales.sharding.spec)]
         for path, q in quantized if isinstance(q, quantized_array.QuantizedArray)}
tokens = [np.asarray(mtp_jax.generate(m, ids, lens, jax.random.key(0), dc).tokens).tolist() for m in (one, many)]
print(json.dumps({"specs": specs, "tokens": tokens}))
"""


@pytest.mark.slow
@pytest.mark.multidevice
def test_int8_on_a_mesh_decodes_as_one_device():
    """DeepSeek-V3-shaped tiny model on 8 host devices (data=2,expert=2,model=2): the int8 values and scales lie as
    their weight does (experts over expert, their width over model; the scales' contracted axes whole) and greedy MTP
    tokens equal one device's."""
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", SHARDED_INT8], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["tokens"][0] == report["tokens"][1]
    specs = report["specs"]
    assert specs["segments/1/layers/mlp/expert_up"] == [[None, "expert", None, "model"]] * 2
    values, scales = specs["segments/0/layers/attn/o_proj"]  # [L, N, W, D]: N, W contracted
    assert values == [None, ["model", "expert"], None, None] and scales == [None] * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp8_model_logits_and_lossless_mtp(name):
    """fp8 e4m3 with 128 x 128 block scales (one block per weight at these sizes): every weight int8 storage
    quantizes is float8; the logits move more than int8's (e4m3 keeps 3 mantissa bits: about 2.6% RMS error per
    weight against int8's 0.6%, and routing and recurrences amplify it); greedy MTP equals plain greedy on the
    stored weights."""
    reference = MODELS[name]()
    model = formats.quantize_model(MODELS[name](), "fp8")
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            stored = param.get_value()
            quantized = contracted_size([str(p) for p in path], stored.shape, "fp8") is not None
            assert isinstance(stored, quantized_array.QuantizedArray) == quantized, path
            assert not quantized or stored.values.dtype == jnp.float8_e4m3fn
    prompts = prompts_for(reference)
    errors = logits_errors(reference, model, prompts)
    print(f"{name}: fp8 logits, error / std of the float32 logits: mean {errors.mean():.4f}, max {errors.max():.4f}")
    assert 0 < errors.mean() < 0.05 and errors.max() < 0.6  # 3 mantissa bits: measured 0.013-0.038, 0.06-0.45

    if name == "gqa":
        return
    plain, drafted = decode(model, prompts, 0), decode(model, prompts, 2)
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_plan_counts_fp8_values_and_block_scales_per_chip():
    """MiMo-7B (every matmul dimension a multiple of 128) on v5e:2x4 (model=8): each quantized weight's shard is one
    byte a value plus its float32 scales, one per 128 x 128 values; the rest as in bfloat16. About half the bytes.
    Attention weights split on head boundaries (a 128-wide head is a whole block), so their scales split 8 ways too;
    the MLP's 11008 = 86 blocks do not split 8 ways, so every chip holds all of an MLP weight's scales."""
    cfg = shapes.full_shape("mimo-7b")
    target = topology.resolve("v5e:2x4")
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,model=8", target.devices))
    bf16 = planning.abstract_model(cfg, jnp.bfloat16, rules, layout="stacked")
    fp8 = planning.abstract_model(cfg, jnp.bfloat16, rules, "fp8", layout="stacked")
    expected = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.split(bf16)[1]))[0]:
        shard = math.prod(leaf.sharding.shard_shape(leaf.shape))
        quantized = contracted_size(sharding.path_names(path), leaf.shape, "fp8") is not None
        scales = leaf.size // (128 * 128) if "mlp" in sharding.path_names(path) else shard // (128 * 128)
        expected += shard + 4 * scales if quantized else 2 * shard
    assert planning.shard_bytes(nnx.split(fp8)[1]) == expected
    assert planning.shard_bytes(nnx.split(fp8)[1]) < 0.6 * planning.shard_bytes(nnx.split(bf16)[1])
