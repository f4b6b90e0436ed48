"""Tiny DeepSeek-V3, GLM-4.5 and Qwen3.5 checkpoints with their MTP layers written as an fp8 release ships them
(e4m3 matmul weights, random block scales) beside the same weights dequantized, and what the fp8-storage, converted
and int4 tests compare on them: the quantized parameters, logits, every parameter's bits."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx
from safetensors.numpy import load_file
from safetensors.torch import save_file

from mtp_jax.quant.quantized_array import QuantizedArray
from tests.support import hybrid_models, moe_models

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


def params_of(model) -> dict[str, np.ndarray]:
    """Every parameter array (a quantized weight's values and scales apart, in row order), by path."""
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    out = {}
    for path, variable in state:
        value = variable.get_value()
        value = value.in_rows() if isinstance(value, QuantizedArray) else value  # (a CPU load's tile order)
        for key, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            out["/".join(map(str, path)) + jax.tree_util.keystr(key)] = np.asarray(leaf)
    return out


def assert_same_params(a, b) -> None:
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        np.testing.assert_array_equal(pa[name].view(np.uint8), pb[name].view(np.uint8), err_msg=name)


def prompts_for(model) -> np.ndarray:
    vocab = model.config.vocab_size
    return np.random.default_rng(3).integers(0, vocab, (len(PROMPT_LENS), PROMPT_LENS.max())).astype(np.int32)
