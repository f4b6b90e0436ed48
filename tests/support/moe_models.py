"""Tiny DeepSeek-V3 and GLM-4.5 checkpoints built with transformers (random weights, released key layout)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

FAMILIES = ("deepseek_v3", "glm4_moe")
RELEASED_DEPTH = {"deepseek_v3": 61, "glm4_moe": 46}  # where transformers looks for the MTP layer
MOE_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    eos_token_id=None,  # generate the full budget on both sides
    bos_token_id=None,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=0.8,  # != mscale: cos/sin scaled by their ratio, the softmax by mscale_all_dim's factor squared
)


def hf_config(family: str, num_layers: int = 3):
    """1 dense layer then MoE layers; DeepSeek with MLA (query LoRA), yarn and 4 expert groups; GLM with partial
    rotary (transformers' default 0.5), q/k norm and qkv bias."""
    if family == "deepseek_v3":
        return DeepseekV3Config(
            **MOE_SHAPE,
            num_hidden_layers=num_layers,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_group=4,
            topk_group=2,
            rope_parameters=YARN,
        )
    return Glm4MoeConfig(
        **MOE_SHAPE,
        num_hidden_layers=num_layers,
        num_key_value_heads=2,
        head_dim=32,
        use_qk_norm=True,
        attention_bias=True,
        n_group=1,
        topk_group=1,
    )


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter ~ N(0, 0.1), norm scales ~ N(1, 0.1), the routers' correction biases ~ N(0, 0.1)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)


def random_hf_model(family: str, num_layers: int = 3, seed: int = 0):
    model = AutoModelForCausalLM.from_config(hf_config(family, num_layers), attn_implementation="eager")
    randomize(model, seed)
    return model.float().eval()


def save_with_mtp_layer(family: str, folder: pathlib.Path, num_layers: int, mtp_copies: bool, seed: int = 0) -> None:
    """A checkpoint of `num_layers` trunk layers plus the MTP layer at `model.layers.{num_layers}`, all in the
    released layout: the MTP decoder layer is the last layer of a model one layer deeper (so its experts are
    per-expert keys, as transformers writes them back), plus enorm / hnorm / eh_proj / shared_head.norm and, with
    `mtp_copies`, embed_tokens / shared_head.head copies of the trunk's (as DeepSeek-V3 ships them)."""
    random_hf_model(family, num_layers + 1, seed).save_pretrained(folder, safe_serialization=True)
    tensors = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(seed)
    d = MOE_SHAPE["hidden_size"]
    prefix = f"model.layers.{num_layers}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    tensors[prefix + "eh_proj.weight"] = (0.1 * rng.standard_normal((d, 2 * d))).astype(np.float32)
    if mtp_copies:
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(config, indent=2))
