"""Converted folders that keep weights quantized (`python -m checkpoints_convert --weights`): an fp8 checkpoint's
e4m3 values and block scales written as they are (`auto`), a float checkpoint's weights quantized at conversion
(`int8`). Loading the folder gives the parameters, bit for bit, and the logits of loading the checkpoint itself with
the same `--weights`; the folder holds fewer bytes than its bfloat16 conversion; greedy MTP equals plain decoding."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from checkpoints_convert.__main__ import main as convert_main
from mtp_jax.parallel import sharding
from mtp_jax.params.stored_weights import QUANTIZED_FILE
from tests.support.fp8_checkpoints import (
    PROMPT_LENS,
    assert_same_params,
    logits_of,
    prompts_for,
    quantized_params,
    write_checkpoint,
    write_fp8_pair,
)

pytestmark = pytest.mark.slow


def folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def test_fp8_checkpoint_converts_to_a_folder_that_keeps_it_fp8(tmp_path):
    write_checkpoint("deepseek_v3", tmp_path / "float32")
    write_fp8_pair(tmp_path / "float32", tmp_path / "fp8", tmp_path / "dequantized")
    kept, wide = tmp_path / "kept", tmp_path / "wide"
    assert convert_main([str(tmp_path / "fp8"), str(kept), "--dtype", "float32"]) == 0  # --weights auto
    assert convert_main([str(tmp_path / "fp8"), str(wide), "--dtype", "float32", "--weights", "bfloat16"]) == 0
    manifest = json.loads((kept / QUANTIZED_FILE).read_text())
    assert manifest and {entry["values_dtype"] for entry in manifest.values()} == {"float8_e4m3fn"}
    assert not (wide / QUANTIZED_FILE).exists()
    assert json.loads((kept / "conversion.json").read_text())["weights"] == "auto"

    direct = mtp_jax.load_model(str(tmp_path / "fp8"), dtype=jnp.float32)  # the checkpoint, fp8 kept
    from_folder = mtp_jax.load_model(str(kept), dtype=jnp.float32)
    assert len(quantized_params(from_folder)) == len(manifest) == len(quantized_params(direct))
    assert_same_params(from_folder, direct)
    prompts = prompts_for(direct)
    np.testing.assert_array_equal(logits_of(from_folder, prompts), logits_of(direct, prompts))
    # float32 elsewhere, so the saving is the quantized weights' 3 of every 4 bytes, less their scales, the manifest
    # and the checkpointer's metadata of the extra arrays (2.49 bytes a value with orbax-checkpoint 0.12.8); one
    # kept as bfloat16 would save 2
    quantized_bytes = sum(q.values.size for q in quantized_params(direct))
    assert folder_bytes(wide) - folder_bytes(kept) > 2.25 * quantized_bytes

    dense = mtp_jax.load_model(str(kept), dtype=jnp.float32, weights="bfloat16")
    assert not quantized_params(dense)
    np.testing.assert_allclose(logits_of(dense, prompts), logits_of(direct, prompts), atol=1e-5, rtol=1e-5)
    on_mesh = mtp_jax.load_model(str(kept), dtype=jnp.float32, mesh=sharding.make_mesh("data=1,model=1"))
    assert_same_params(on_mesh, direct)


def test_float_checkpoint_converted_to_int8_loads_as_int8_and_decodes_losslessly(tmp_path):
    write_checkpoint("glm4_moe", tmp_path / "float32")
    folder = tmp_path / "int8"
    assert convert_main([str(tmp_path / "float32"), str(folder), "--dtype", "float32", "--weights", "int8"]) == 0
    manifest = json.loads((folder / QUANTIZED_FILE).read_text())
    assert {entry["values_dtype"] for entry in manifest.values()} == {"int8"}

    direct = mtp_jax.load_model(str(tmp_path / "float32"), dtype=jnp.float32, weights="int8")
    model = mtp_jax.load_model(str(folder), dtype=jnp.float32)
    assert len(quantized_params(model)) == len(manifest) == len(quantized_params(direct))
    assert_same_params(model, direct)

    prompts = prompts_for(model)
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=12, stop_on_eos=False)
    plain = mtp_jax.generate(model, prompts, PROMPT_LENS, jax.random.key(0), dataclasses.replace(cfg, num_draft=0))
    drafted = mtp_jax.generate(model, prompts, PROMPT_LENS, jax.random.key(0), cfg)
    np.testing.assert_array_equal(np.asarray(drafted.tokens), np.asarray(plain.tokens))
