"""Tiny Qwen3-Next / Qwen3.5 checkpoints built with transformers (random weights), saved in the released layouts with
the MTP layer added (transformers drops `mtp.*` on save), and a predictable hybrid model of our own for loop tests."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
)

import mtp_jax
from mtp_jax.config.model import GatedDeltaNetConfig, ModelConfig, MtpConfig, RopeConfig

# qwen3_5: the VLM wrapper (trunk under model.language_model., a vision tower to ignore), dense MLPs;
# qwen3_5_moe_text: fused experts in the trunk, per-expert in the MTP layer; qwen3_next: fused DeltaNet projections,
# per-expert experts, picked probabilities not renormalised.
FAMILIES = ("qwen3_5", "qwen3_5_moe_text", "qwen3_next")
LAYER_TYPES = ["linear_attention", "full_attention"] * 2  # one group of two layers, repeated twice
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=24)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)


def _hf_model(family: str, num_layers: int):
    layer_types = [*LAYER_TYPES, "full_attention"][:num_layers]
    text = dict(TEXT, num_hidden_layers=num_layers, layer_types=layer_types)
    if family == "qwen3_5":
        return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION))
    if family == "qwen3_next":
        config = Qwen3NextConfig(**text, **MOE, norm_topk_prob=False)
    else:
        config = Qwen3_5MoeTextConfig(**text, **MOE)
    return AutoModelForCausalLM.from_config(config)


def random_hf_model(family: str, num_layers: int, seed: int = 0):
    """Every parameter ~ N(0, 0.1) (the (1 + w) norms around 1), decays A_log ~ U(-1, 1); float32, eager."""
    model = _hf_model(family, num_layers)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    model.config._attn_implementation = "eager"
    return model.float().eval()


def save_with_mtp_layer(family: str, folder: pathlib.Path, seed: int = 0) -> tuple[torch.nn.Module, list[str]]:
    """A checkpoint of len(LAYER_TYPES) trunk layers plus the MTP layer, in the released layout: the MTP decoder
    layer is the last (full-attention) layer of a model one layer deeper, renamed to `mtp.layers.0.`, plus random
    `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}`. Returns (transformers' model of the trunk alone, with
    the checkpoint's weights; the per-expert names it fused: fused trunk experts for qwen3_5_moe_text, as
    Qwen3.5-MoE ships them)."""
    num_layers = len(LAYER_TYPES)
    deeper = random_hf_model(family, num_layers + 1, seed)
    deeper.save_pretrained(folder, safe_serialization=True)
    trunk = random_hf_model(family, num_layers, seed)
    missing, _ = trunk.load_state_dict(deeper.state_dict(), strict=False)
    assert not missing, missing
    tensors = load_file(str(folder / "model.safetensors"))
    root = "model.language_model." if family == "qwen3_5" else "model."
    mtp_layer = f"{root}layers.{num_layers}."
    tensors = {(f"mtp.layers.0.{k[len(mtp_layer) :]}" if k.startswith(mtp_layer) else k): v for k, v in tensors.items()}
    rng = np.random.default_rng(seed)
    d = TEXT["hidden_size"]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = (0.1 * rng.standard_normal(d)).astype(np.float32)
    tensors["mtp.fc.weight"] = (0.1 * rng.standard_normal((d, 2 * d))).astype(np.float32)
    fused = []
    if family == "qwen3_5_moe_text":
        for layer in range(num_layers):
            prefix = f"{root}layers.{layer}.mlp.experts."
            experts = range(MOE["num_experts"])
            names = {p: [f"{prefix}{e}.{p}.weight" for e in experts] for p in ("gate_proj", "up_proj", "down_proj")}
            gate, up, down = (np.stack([tensors.pop(n) for n in names[p]]) for p in names)
            tensors[prefix + "gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2F, D]
            tensors[prefix + "down_proj"] = down  # [E, D, F]
            fused += [n for group in names.values() for n in group]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"] if family == "qwen3_5" else config
    text["num_hidden_layers"], text["layer_types"] = num_layers, LAYER_TYPES
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return trunk, fused


def hybrid_config(vocab: int = 24, eos: tuple[int, ...] = (3,), num_layers: int = 6) -> ModelConfig:
    """A tiny Qwen3.5-shaped config of our own: groups of (DeltaNet, DeltaNet, gated attention), dense MLPs."""
    layer_types = (("linear_attention",) * 2 + ("full_attention",)) * (num_layers // 3 + 1)
    return ModelConfig(
        family="qwen3_5_text",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope=RopeConfig(partial_factor=0.5),
        eos_token_ids=eos,
        mtp=MtpConfig(layout="qwen_next", recurse_normed=True),
        linear_attention=GatedDeltaNetConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8),
        layer_types=layer_types[:num_layers],
        gated_attention=True,
        zero_centered_norms=True,
    )


def predictable_hybrid_model(seed: int, context_scale: float = 0.3, noise: float = 0.02, cfg=None):
    """As tests/support/tiny_models.py's predictable_model, for a hybrid trunk: every token mixer's and MLP's output
    scaled down (still context-dependent), an MTP head wired to apply the trunk's near-bigram map to its input token."""
    model = mtp_jax.CausalLM(cfg or hybrid_config(), rngs=nnx.Rngs(seed))
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and str(path[-1]) in ("o_proj", "out_proj", "down_proj"):
            node[...] = node[...] * (noise if str(path[0]) == "mtp" else context_scale)
    d = model.config.hidden_size
    select_token = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)  # [2D, D]: [e, h] -> e
    model.mtp.proj[...] = select_token + noise * jax.random.normal(jax.random.key(seed + 1), select_token.shape)
    return model
