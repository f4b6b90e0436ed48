"""4-bit weight storage (`--weights int4`, mtp_jax.quant.int4.quantize_int4): blocks of 32 contracting elements, each
value 0..15 times the block's float16 scale plus its float16 min, two values a byte: the layout of llama.cpp's Q4_1.

- From the dequantized weights of a Q4_1 tensor that gguf-py (llama.cpp's Python package) quantized, int4 finds the
  same blocks again: every weight bit for bit, in exactly Q4_1's bytes.
- On any other weight, each value lies within half a step of its block's grid.
- On the tiny GQA, latent-attention + experts and hybrid models: the stored bytes are about 5 bits a matmul weight
  (embeddings and lm_heads stay int8), the logits stay near the float32 model's (the error is printed), and greedy MTP
  decoding equals plain greedy decoding of the 4-bit model.
- A folder converted with `--weights int4` loads as the same 4-bit model.
- Q8_0 blocks (int8 values, a float16 scale per 32) are found again the same way, and the default model's GGUF
  (Q4_1 layers, a Q8_0 embedding) loads under `weights="auto"` with every such weight in its blocks, equal bit for
  bit to the GGUF dequantized, and written to and read back from the warm-start cache's state file as stored.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

import mtp_jax
from checkpoints_convert.__main__ import main as convert_main
from mtp_jax.conversion.convert import config_of
from mtp_jax.conversion.placement import read_params
from mtp_jax.params.open_source import open_source
from mtp_jax.params.state_file import STATE_FILE, read_state, write_state
from mtp_jax.params.stored_weights import QUANTIZED_FILE
from mtp_jax.quant import formats, int4, int8, quantized_array
from tests.support.decode_models import MODELS, decode, prompts_for
from tests.support.fp8_checkpoints import PROMPT_LENS as FOLDER_PROMPT_LENS
from tests.support.fp8_checkpoints import assert_same_params, quantized_params, write_checkpoint
from tests.support.fp8_checkpoints import prompts_for as folder_prompts
from tests.support.quant_checks import HEADS, contracted_axes, logits_errors

pytestmark = pytest.mark.slow


def test_int4_finds_llama_cpp_q4_1_blocks_again():
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(96, 256)).astype(np.float32)  # GGUF's [out, in]: blocks of 32 along `in`
    blocks = gguf_quantize(weight, GGMLQuantizationType.Q4_1)
    shipped = gguf_dequantize(blocks, GGMLQuantizationType.Q4_1)  # what a checkpoint's Q4_1 tensor holds
    ours = int4.quantize_int4(jnp.asarray(shipped.T), (0,))  # our [in, out], contracting `in`
    assert ours.packed and ours.scales.shape == (8, 96) and ours.scales.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(ours.dequantize()), shipped.T)
    assert ours.nbytes == blocks.nbytes  # 20 bytes per 32 values: 16 of values, a float16 scale and a float16 min


def test_int8_blocks_find_llama_cpp_q8_0_blocks_again():
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(40, 128)).astype(np.float32)  # GGUF's [out, in]
    blocks = gguf_quantize(weight, GGMLQuantizationType.Q8_0)
    shipped = gguf_dequantize(blocks, GGMLQuantizationType.Q8_0)
    ours = int8.quantize_int8_blocks(jnp.asarray(shipped), (1,))  # an embedding's layout: [V, D], contracting D
    assert ours.values.dtype == jnp.int8 and ours.scales.shape == (40, 4) and ours.scales.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(ours.dequantize()), shipped)
    assert ours.nbytes == blocks.nbytes  # 34 bytes per 32 values


def test_the_default_gguf_loads_in_its_own_blocks(smollm2_path, tmp_path):
    source = open_source(smollm2_path)
    cfg = config_of(source)
    kept = read_params(source, cfg, jnp.float32, None, keep_blocks=True)
    dense = read_params(source, cfg, jnp.float32, None)
    formats = {}
    for path, value in kept.items():
        if isinstance(value, quantized_array.QuantizedArray):
            formats[path[-1]] = (value.values.dtype.name, value.mins is not None)
            np.testing.assert_array_equal(np.asarray(value.dequantize()), np.asarray(dense[path]), err_msg=str(path))
        else:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(dense[path]))
    layers = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert formats == {"embed": ("int8", False)} | {name: ("uint8", True) for name in layers}

    state = tmp_path / STATE_FILE  # the warm-start cache's form: values, scales and mins under the weight's path
    flat = {}
    for path, value in kept.items():
        if isinstance(value, quantized_array.QuantizedArray):
            parts = {"values": value.values, "scales": value.scales, "mins": value.mins}
            flat |= {(*path, part): np.asarray(a) for part, a in parts.items() if a is not None}
        else:
            flat[path] = np.asarray(value)
    write_state(str(state), flat)
    back = jax.tree.leaves(
        read_state(str(state), cfg, jnp.float32, None), is_leaf=lambda x: isinstance(x, quantized_array.QuantizedArray)
    )
    assert sum(isinstance(v, quantized_array.QuantizedArray) for v in back) == len(formats)
    assert sum(v.nbytes for v in back) == sum(v.nbytes for v in kept.values())


def test_int4_values_lie_within_half_a_step():
    rng = np.random.default_rng(1)
    weight = jnp.asarray(rng.standard_t(3, size=(2, 160, 48)), jnp.float32)  # heavy tails; blocks of 32 over 160
    q = int4.quantize_int4(weight, (1,))
    assert q.scales.shape == (2, 5, 48) and q.values.shape == (2, 160, 24)
    step = quantized_array.expand_blocks(q.scales.astype(jnp.float32), q.shape)
    error = jnp.abs(q.dequantize() - weight)
    assert float(jnp.max(error / step)) <= 0.5 + 1e-2  # float16's rounding of the min moves the grid a little
    odd = int4.quantize_int4(weight[..., :47], (1,))  # an odd last axis: one value a byte (int8 levels)
    assert not odd.packed and odd.values.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(odd.dequantize()), np.asarray(q.dequantize())[..., :47])


def expected_bytes(model) -> int:
    """Bytes of `model`'s parameters once int4 (counted here apart from quant.py): a matmul weight half a byte a
    value plus a float16 scale and min per block of 32 contracting values (`axis_blocks`: fewer where 32 does not
    divide them);
    an embedding or lm_head int8 with a float32 scale per vocabulary entry; the rest as it is."""
    total = 0
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param):
            continue
        names, value = [str(p) for p in path], param.get_value()
        axes = contracted_axes(names, "int8")
        if axes is None:
            total += value.nbytes
        elif tuple(names) in HEADS:
            total += value.size + 4 * value.size // value.shape[axes[0]]
        else:
            block = int(np.prod(quantized_array.axis_blocks([value.shape[a] for a in axes], 32)))  # 32 where it divides
            per_value = 0.5 if value.shape[-1] % 2 == 0 else 1
            total += int(value.size * per_value) + 4 * value.size // block
    return total


@pytest.mark.parametrize("name", sorted(MODELS))
def test_int4_model_bytes_logits_and_lossless_mtp(name):
    reference = MODELS[name]()
    model = formats.quantize_model(MODELS[name](), "int4")
    assert quantized_array.weight_bytes(model) == expected_bytes(reference)
    prompts = prompts_for(reference)
    errors = logits_errors(reference, model, prompts)
    print(f"{name}: int4 logits, error / std of the float32 logits: mean {errors.mean():.4f}, max {errors.max():.4f}")
    # measured: mean 0.039-0.082, max 0.24-0.60 (int8: 0.007-0.013, 0.03-0.23; 4 bits a weight against 8)
    assert 0 < errors.mean() < 0.15 and errors.max() < 1.0
    if name == "gqa":  # the same 4-bit path as the other two; its decode is left to them
        return
    plain, drafted = decode(model, prompts, 0), decode(model, prompts, 2)
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
    np.testing.assert_array_equal(drafted.lengths, plain.lengths)


def test_float_checkpoint_converted_to_int4_loads_as_int4(tmp_path):
    write_checkpoint("glm4_moe", tmp_path / "float32")
    folder = tmp_path / "int4"
    assert convert_main([str(tmp_path / "float32"), str(folder), "--dtype", "float32", "--weights", "int4"]) == 0
    manifest = json.loads((folder / QUANTIZED_FILE).read_text())
    assert {entry["values_dtype"] for entry in manifest.values()} >= {"uint8", "int8"}  # layers; heads
    direct = mtp_jax.load_model(str(tmp_path / "float32"), dtype=jnp.float32, weights="int4")
    model = mtp_jax.load_model(str(folder), dtype=jnp.float32)
    assert len(quantized_params(model)) == len(manifest) == len(quantized_params(direct))
    assert_same_params(model, direct)
    prompts, lens = folder_prompts(model), FOLDER_PROMPT_LENS
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=12, stop_on_eos=False)
    plain = mtp_jax.generate(model, prompts, lens, jax.random.key(0), dataclasses.replace(cfg, num_draft=0))
    drafted = mtp_jax.generate(model, prompts, lens, jax.random.key(0), cfg)
    np.testing.assert_array_equal(np.asarray(drafted.tokens), np.asarray(plain.tokens))


@pytest.mark.parametrize("form", ["int4", "int8", "int8_blocks"])
def test_draft_vocabulary_rows_and_columns_of_a_quantized_head(form):
    """The draft vocabulary's rows of an embedding [V, D] and columns of an lm_head [D, V] (a GGUF may ship either in
    Q4_1 or Q8_0): taken quantized, they dequantize to the rows / columns of the dequantized weight."""
    quantize = {"int4": int4.quantize_int4, "int8": int8.quantize_int8, "int8_blocks": int8.quantize_int8_blocks}
    rng = np.random.default_rng(3)
    ids = jnp.asarray([5, 0, 9, 2])
    head = quantize[form](jnp.asarray(rng.normal(size=(64, 12)), jnp.float32), (0,))  # [D, V]
    np.testing.assert_array_equal(
        np.asarray(quantized_array.take_columns(head, ids).dequantize()), np.asarray(head.dequantize())[:, ids].T
    )
    embed = quantize[form](jnp.asarray(rng.normal(size=(12, 64)), jnp.float32), (1,))  # [V, D]
    rows = np.asarray(embed.dequantize())[ids]
    np.testing.assert_array_equal(np.asarray(quantized_array.take_quantized_rows(embed, ids).dequantize()), rows)
    np.testing.assert_array_equal(np.asarray(quantized_array.take_rows(embed, ids)), rows)


def test_gguf_blocks_are_kept_only_where_the_cpu_kernel_reads_them(monkeypatch):
    """Elsewhere XLA unpacks 4-bit values into a full-size array before each dot: dequantized on load instead."""
    assert mtp_jax.loading.checkpoint.keeps_gguf_blocks("auto", None)
    assert not mtp_jax.loading.checkpoint.keeps_gguf_blocks("bfloat16", None)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert not mtp_jax.loading.checkpoint.keeps_gguf_blocks("auto", None)
