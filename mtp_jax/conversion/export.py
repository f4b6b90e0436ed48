"""Model parameters -> Hugging Face tensors (the key table run backwards), and an HF folder writer.

Used to save MTP heads in the DeepSeek-style layout and to build test checkpoints in released layouts.
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from mtp_jax.config.model import ModelConfig
from mtp_jax.conversion.convert import candidate_targets
from mtp_jax.families.registry import family_of
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.params.transforms import Linear
from mtp_jax.runtime.errors import ConversionError


def hf_tensors(model: CausalLM, only_mtp: bool = False) -> dict[str, np.ndarray]:
    """Every parameter of `model` under its HF name, in the HF layout ([out, in] for linears). Families that cannot
    be written (Qwen3-Next, Qwen3.5: their checkpoints fuse several parameters into one tensor) are refused."""
    if family_of(model.config.family).export_config is None:
        raise ConversionError(f"writing {model.config.family} checkpoints is not supported (fused tensors)")
    flat = {tuple(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}
    tensors = {}
    for name, target in candidate_targets(model.config):
        if target.path not in flat or (only_mtp and target.path[0] != "mtp"):
            continue
        value = flat[target.path][target.index]
        if isinstance(target.transform, Linear):
            value = value.reshape(target.transform.hf_shape(value.shape)[::-1]).T
        else:
            value = value.reshape(target.transform.hf_shape(value.shape))
        tensors[name] = np.ascontiguousarray(value)
    return tensors


def hf_config(cfg: ModelConfig) -> dict:
    """A `config.json` dict that `model_config_from_hf` maps back to `cfg`: the fields every family shares, then the
    family's own (`Family.export_config`)."""
    config = {
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.theta},
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": list(cfg.eos_token_ids) or None,
        "bos_token_id": cfg.bos_token_id,
    }
    if cfg.rope.kind == "llama3":
        config["rope_parameters"].update(
            rope_type="llama3",
            factor=cfg.rope.factor,
            low_freq_factor=cfg.rope.low_freq_factor,
            high_freq_factor=cfg.rope.high_freq_factor,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
        )
    if cfg.rope.kind == "yarn":
        config["rope_parameters"].update(
            rope_type="yarn",
            factor=cfg.rope.factor,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
            beta_fast=cfg.rope.beta_fast,
            beta_slow=cfg.rope.beta_slow,
            truncate=cfg.rope.truncate,
            attention_factor=cfg.rope.attention_factor,
            mscale_all_dim=cfg.rope.mscale_all_dim,
        )
    if cfg.rope.partial_factor != 1.0:
        config["rope_parameters"]["partial_rotary_factor"] = cfg.rope.partial_factor
    config["num_nextn_predict_layers"] = cfg.mtp.num_layers if cfg.has_mtp else 0
    return family_of(cfg.family).export_config(cfg, config)


def save_hf_folder(model: CausalLM, path: str) -> None:
    """Write `config.json` + `model.safetensors` for `model` (float32 or bf16 as the params are)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(model.config), f, indent=2)
    save_file(hf_tensors(model), os.path.join(path, "model.safetensors"))
