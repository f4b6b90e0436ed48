"""fp8 weights kept as the checkpoint ships them: float8 e4m3 values and their block scales stay in the model
(`--weights auto`), dequantized inside the jitted step.

Tiny DeepSeek-V3, GLM-4.5 and Qwen3.5 checkpoints with their MTP layers are written twice: every matmul weight as fp8
with random 8 x 8 block scales (the rest float32), and as those weights dequantized by hand, element by element
(tests/test_fp8.py's reference). Loaded with the fp8 kept, the model holds one float8 byte per quantized weight; its
logits equal the dequantized checkpoint's and transformers' on it; greedy MTP decoding equals plain decoding.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import mtp_jax
from mtp_jax.quant import QuantizedArray
from tests import hybrid_models, moe_models

BLOCK = 8  # small enough that the tiny shapes hold several blocks per weight
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8]}
PROMPT_LENS = np.array([7, 3, 5])


def reference_dequantize(fp8: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """float32 fp8[i, j] * scale_inv[i // BLOCK, j // BLOCK], indexed element by element."""
    rows, cols = np.arange(fp8.shape[0])[:, None], np.arange(fp8.shape[1])[None, :]
    return fp8.astype(np.float32) * scale_inv[rows // BLOCK, cols // BLOCK]


def is_matmul_weight(name: str, value: np.ndarray) -> bool:
    """The projections an fp8 release quantizes: attention, MLPs, experts, DeltaNet, the MTP fusion; not the
    routers, norms, embeddings or heads."""
    projection = name.endswith(("proj.weight", "proj_with_mqa.weight", "mtp.fc.weight"))
    return value.ndim == 2 and projection and ".mlp.gate." not in name and "shared_expert_gate" not in name


def write_fp8_pair(source, fp8, dequantized, seed: int = 0) -> int:
    """From the float32 checkpoint folder `source`: `fp8` (matmul weights e4m3 + scale_inv, random scales per
    block) and `dequantized` (those weights as the fp8 folder holds them, in float32). Returns how many tensors are
    stored fp8."""
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    rng = np.random.default_rng(seed)
    stored, plain = {}, {}
    for name, value in tensors.items():
        if not is_matmul_weight(name, value):
            stored[name] = plain[name] = torch.from_numpy(value)
            continue
        blocks = tuple(-(-n // BLOCK) for n in value.shape)
        scale_inv = rng.uniform(0.5, 2.0, blocks).astype(np.float32) * np.abs(value).max() / 448
        rows, cols = np.arange(value.shape[0])[:, None], np.arange(value.shape[1])[None, :]
        scaled = np.clip(value / scale_inv[rows // BLOCK, cols // BLOCK], -448, 448)  # e4m3fn has no inf
        values = scaled.astype(ml_dtypes.float8_e4m3fn)
        stored[name] = torch.from_numpy(values.view(np.uint8)).view(torch.float8_e4m3fn)
        stored[name + "_scale_inv"] = torch.from_numpy(scale_inv)
        plain[name] = torch.from_numpy(reference_dequantize(values, scale_inv))
    for folder, tensors_out, quant in ((fp8, stored, QUANTIZATION), (dequantized, plain, None)):
        folder.mkdir()
        save_file(tensors_out, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return len(stored) - len(tensors)


def write_checkpoint(family: str, folder) -> None:
    if family in hybrid_models.FAMILIES:
        hybrid_models.save_with_mtp_layer(family, folder)
    else:
        moe_models.save_with_mtp_layer(family, folder, num_layers=2, mtp_copies=False)


def quantized_params(model) -> list[QuantizedArray]:
    values = [p.get_value() for _, p in nnx.iter_graph(model) if isinstance(p, nnx.Param)]
    return [v for v in values if isinstance(v, QuantizedArray)]


def logits_of(model, prompts: np.ndarray) -> np.ndarray:
    positions = jnp.broadcast_to(jnp.arange(prompts.shape[1]), prompts.shape)
    hidden, _ = model.trunk(jnp.asarray(prompts), positions, model.new_cache(len(prompts), 16), PROMPT_LENS)
    return np.asarray(model.logits(hidden))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_5"])
def test_fp8_checkpoint_stays_fp8_and_decodes_as_dequantized(family, tmp_path):
    write_checkpoint(family, tmp_path / "float32")
    count = write_fp8_pair(tmp_path / "float32", tmp_path / "fp8", tmp_path / "dequantized")
    fp8 = mtp_jax.load_model(str(tmp_path / "fp8"), dtype=jnp.float32)
    dequantized = mtp_jax.load_model(str(tmp_path / "dequantized"), dtype=jnp.float32)

    kept = quantized_params(fp8)
    assert kept and not quantized_params(dequantized)
    if family == "deepseek_v3":  # --weights bfloat16 dequantizes on load; fp8 keeps the checkpoint's own choice
        assert not quantized_params(mtp_jax.load_model(str(tmp_path / "fp8"), dtype=jnp.float32, weights="bfloat16"))
        as_fp8 = mtp_jax.load_model(str(tmp_path / "fp8"), dtype=jnp.float32, weights="fp8")
        assert [q.shape for q in quantized_params(as_fp8)] == [q.shape for q in kept]
    assert all(q.values.dtype == jnp.float8_e4m3fn and q.scales.dtype == jnp.float32 for q in kept)
    # every fp8 tensor of the checkpoint is one slot of a kept parameter (layers and experts stack slots)
    slots = sum(int(np.prod(q.shape[: q.ndim - 2])) if q.ndim > 2 else 1 for q in kept)
    assert slots >= count // 4 and sum(q.values.size for q in kept) > 0

    vocab = fp8.config.vocab_size
    prompts = np.random.default_rng(3).integers(0, vocab, (len(PROMPT_LENS), PROMPT_LENS.max())).astype(np.int32)
    ours = logits_of(fp8, prompts)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, logits_of(dequantized, prompts), atol=1e-5, rtol=1e-5)
    if family not in hybrid_models.FAMILIES:  # transformers' model of the hand-dequantized weights
        reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = reference(torch.from_numpy(prompts).long()).logits.numpy()
        row = 0  # the longest prompt: no padding
        np.testing.assert_allclose(ours[row], theirs[row], atol=2e-4, rtol=2e-4)

    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=12, stop_on_eos=False)
    plain = mtp_jax.generate(fp8, prompts, PROMPT_LENS, jax.random.key(0), dataclasses.replace(cfg, num_draft=0))
    drafted = mtp_jax.generate(fp8, prompts, PROMPT_LENS, jax.random.key(0), cfg)
    np.testing.assert_array_equal(np.asarray(drafted.tokens), np.asarray(plain.tokens))


SHARDED_LOAD = """
import sys, json, jax, jax.numpy as jnp, numpy as np
import mtp_jax
from mtp_jax import sharding
from mtp_jax.quant import QuantizedArray
from flax import nnx
folder = sys.argv[1]
ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 7)), jnp.int32)
lens = jnp.array([7, 3, 5, 6], jnp.int32)
dc = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=10, stop_on_eos=False)
one = mtp_jax.load_model(folder, dtype=jnp.float32)
many = mtp_jax.load_model(folder, dtype=jnp.float32, mesh=sharding.make_mesh("data=2,expert=2,model=2"))
kept = [p.get_value() for _, p in nnx.iter_graph(many) if isinstance(p, nnx.Param)]
kept = [q for q in kept if isinstance(q, QuantizedArray)]
split = sum(not q.values.sharding.is_fully_replicated for q in kept)
tokens = [np.asarray(mtp_jax.generate(m, ids, lens, jax.random.key(0), dc).tokens).tolist() for m in (one, many)]
print(json.dumps({"kept": len(kept), "split": split, "tokens": tokens}))
"""


def test_fp8_checkpoint_on_a_mesh_decodes_as_one_device(tmp_path):
    """The same fp8 DeepSeek-V3 checkpoint loaded onto 8 host devices (data=2,expert=2,model=2): every process
    reads the blocks of values and scales its devices hold; the values are split as their weights and greedy MTP
    tokens equal one device's."""
    write_checkpoint("deepseek_v3", tmp_path / "float32")
    write_fp8_pair(tmp_path / "float32", tmp_path / "fp8", tmp_path / "dequantized")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SHARDED_LOAD, str(tmp_path / "fp8")], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kept"] > 10 and report["split"] > 5
    assert report["tokens"][0] == report["tokens"][1]
