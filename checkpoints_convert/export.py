"""Model parameters -> Hugging Face tensors (the key table run backwards), and an HF folder writer.

Used to save MTP heads in the DeepSeek-style layout and to build test checkpoints in released layouts.
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import nnx

from checkpoints_convert.convert import candidate_targets
from checkpoints_convert.errors import ConversionError
from checkpoints_convert.key_table import Linear
from mtp_jax.config import ModelConfig
from mtp_jax.models.causal_lm import CausalLM


def hf_tensors(model: CausalLM, only_mtp: bool = False) -> dict[str, np.ndarray]:
    """Every parameter of `model` under its HF name, in the HF layout ([out, in] for linears). Hybrid families
    (Qwen3-Next, Qwen3.5), whose checkpoints fuse several parameters into one tensor, are refused."""
    if model.config.is_hybrid:
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
    """A `config.json` dict that `model_config_from_hf` maps back to `cfg`."""
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
    if cfg.family in ("llama", "qwen3", "glm4_moe"):
        config["attention_bias"] = cfg.qkv_bias
    if cfg.family == "llama":
        config["mlp_bias"] = cfg.mlp_bias
    if cfg.family == "glm4_moe":
        config["use_qk_norm"] = cfg.qk_norm
    if cfg.mla is not None:
        m = cfg.mla
        del config["head_dim"]
        config.update(
            q_lora_rank=m.q_lora_rank or None,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
            rope_interleave=cfg.rope.interleaved,
        )
    if cfg.moe is not None:
        e = cfg.moe
        config.update(
            n_routed_experts=e.num_experts,
            num_experts_per_tok=e.experts_per_token,
            moe_intermediate_size=e.expert_intermediate_size,
            n_shared_experts=e.num_shared_experts,
            n_group=e.num_groups,
            topk_group=e.topk_groups,
            routed_scaling_factor=e.routed_scaling_factor,
            norm_topk_prob=e.norm_topk_prob,
            first_k_dense_replace=e.first_dense_layers,
        )
    config["num_nextn_predict_layers"] = cfg.mtp.num_layers if cfg.has_mtp else 0
    return config


def save_hf_folder(model: CausalLM, path: str) -> None:
    """Write `config.json` + `model.safetensors` for `model` (float32 or bf16 as the params are)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(model.config), f, indent=2)
    save_file(hf_tensors(model), os.path.join(path, "model.safetensors"))
