"""fp8 e4m3 checkpoints with 128x128 block scales (DeepSeek-V3's release format) convert to the dequantized values.

The expected values are computed here element by element, W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128],
independently of mtp_jax/params/fp8.py's block expansion.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

from mtp_jax.conversion.convert import config_of, convert_params
from mtp_jax.params.fp8 import dequantize
from mtp_jax.params.open_source import open_source
from mtp_jax.runtime.errors import ConversionError
from tests.support.moe_models import random_hf_model

BLOCK = 128
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def reference_dequantize(fp8_bits: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """float32 fp8[i, j] * scale_inv[i // 128, j // 128], indexed element by element."""
    rows, cols = np.arange(fp8_bits.shape[0])[:, None], np.arange(fp8_bits.shape[1])[None, :]
    return fp8_bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale_inv[rows // BLOCK, cols // BLOCK]


def quantize(weight: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv [ceil(out / 128), ceil(in / 128)]) with a random scale per block."""
    blocks = tuple(-(-n // BLOCK) for n in weight.shape)
    scale_inv = rng.uniform(0.5, 2.0, blocks).astype(np.float32) * np.abs(weight).max() / 448
    rows, cols = np.arange(weight.shape[0])[:, None], np.arange(weight.shape[1])[None, :]
    scaled = torch.from_numpy(weight / scale_inv[rows // BLOCK, cols // BLOCK])
    return scaled.to(torch.float8_e4m3fn), torch.from_numpy(scale_inv)


def test_dequantize_covers_edge_blocks():
    """A 300 x 200 weight: 3 x 2 blocks, the last row and column of blocks partial."""
    rng = np.random.default_rng(0)
    weight, scale_inv = quantize(rng.standard_normal((300, 200)).astype(np.float32), rng)
    assert scale_inv.shape == (3, 2)
    bits = weight.view(torch.uint8).numpy()
    got = dequantize(bits.view(ml_dtypes.float8_e4m3fn), scale_inv.numpy(), (BLOCK, BLOCK))
    np.testing.assert_array_equal(got, reference_dequantize(bits, scale_inv.numpy()))


def _is_quantized(name: str, value: np.ndarray) -> bool:
    """DeepSeek-V3 quantizes the attention and MLP projections (experts included), not the router, norms,
    embedding or lm_head."""
    return value.ndim == 2 and name.endswith("proj.weight") and ".mlp.gate." not in name


def test_fp8_checkpoint_converts_to_dequantized_values(tmp_path):
    """The same tiny DeepSeek-V3 written twice: fp8 + scales (the rest bf16) and the hand-dequantized float32 values
    (the rest the same bf16); both convert to identical parameters, and every fp8 weight consumes its scale."""
    hf = random_hf_model("deepseek_v3", num_layers=2)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    rng = np.random.default_rng(1)
    quantized, dequantized = {}, {}
    for name, value in original.items():
        if _is_quantized(name, value):
            weight, scale_inv = quantize(value, rng)
            quantized[name], quantized[name + "_scale_inv"] = weight, scale_inv
            dequantized[name] = torch.from_numpy(
                reference_dequantize(weight.view(torch.uint8).numpy(), scale_inv.numpy())
            )
        else:
            quantized[name] = dequantized[name] = torch.from_numpy(value).to(torch.bfloat16)
    num_scales = len(quantized) - len(original)
    assert num_scales > 10
    for folder, tensors, quant in (("fp8", quantized, QUANTIZATION), ("dequantized", dequantized, None)):
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))

    source, plain = open_source(str(tmp_path / "fp8")), open_source(str(tmp_path / "dequantized"))
    cfg = config_of(source)
    assert cfg == config_of(plain)
    got, plan = convert_params(source, cfg, jnp.float32)
    want, _ = convert_params(plain, cfg, jnp.float32)
    assert len(plan.targets) + len(plan.ignored) == len(original)  # the scales are consumed, not counted
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg="/".join(path))


def test_fp8_weight_without_scale_is_refused(tmp_path):
    rng = np.random.default_rng(2)
    weight, _ = quantize(rng.standard_normal((8, 8)).astype(np.float32), rng)
    tmp_path.joinpath("config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "quantization_config": QUANTIZATION})
    )
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConversionError, match="fp8 tensor w has no w_scale_inv"):
        open_source(str(tmp_path)).read("w")
