"""Key tables the families share: Hugging Face tensor name -> (parameter path, transform).

A grouped-query or latent-attention decoder layer with a dense or routed-expert MLP (`STANDARD_LAYER`, the routed
experts' per-expert keys `ROUTED_EXPERT`), the trunk's root tensors, and the MTP module's fusion tensors per MTP
layout (a layout may be used by several families: heads trained here are written in the DeepSeek one).
"""

from __future__ import annotations

from mtp_jax.config.model import ModelConfig
from mtp_jax.params.transforms import COPY, FLAT, Linear, Transform

LayerEntry = tuple[str, tuple[str, ...], Transform]  # (HF suffix under the layer's prefix, path under the layer, how)


# One decoder layer: HF suffix -> (path under the layer module, transform). Bias entries apply when present.
DECODER_LAYER = {
    "input_layernorm.weight": (("input_norm", "scale"), COPY),
    "post_attention_layernorm.weight": (("post_attention_norm", "scale"), COPY),
    "self_attn.q_proj.weight": (("attn", "q_proj"), Linear(1)),
    "self_attn.k_proj.weight": (("attn", "k_proj"), Linear(1)),
    "self_attn.v_proj.weight": (("attn", "v_proj"), Linear(1)),
    "self_attn.o_proj.weight": (("attn", "o_proj"), Linear(2)),
    "self_attn.q_proj.bias": (("attn", "q_bias"), FLAT),
    "self_attn.k_proj.bias": (("attn", "k_bias"), FLAT),
    "self_attn.v_proj.bias": (("attn", "v_bias"), FLAT),
    "self_attn.o_proj.bias": (("attn", "o_bias"), FLAT),
    "self_attn.q_norm.weight": (("attn", "q_norm", "scale"), COPY),
    "self_attn.k_norm.weight": (("attn", "k_norm", "scale"), COPY),
    "mlp.gate_proj.weight": (("mlp", "gate_proj"), Linear(1)),
    "mlp.up_proj.weight": (("mlp", "up_proj"), Linear(1)),
    "mlp.down_proj.weight": (("mlp", "down_proj"), Linear(1)),
    "mlp.gate_proj.bias": (("mlp", "gate_bias"), FLAT),
    "mlp.up_proj.bias": (("mlp", "up_bias"), FLAT),
    "mlp.down_proj.bias": (("mlp", "down_bias"), FLAT),
}

# Multi-head latent attention (DeepSeek); `self_attn.q_proj` (no query LoRA) and `self_attn.o_proj` as above.
MLA_ATTENTION = {
    "self_attn.q_a_proj.weight": (("attn", "q_a_proj"), Linear(1)),
    "self_attn.q_a_layernorm.weight": (("attn", "q_a_norm", "scale"), COPY),
    "self_attn.q_b_proj.weight": (("attn", "q_b_proj"), Linear(1)),
    "self_attn.kv_a_proj_with_mqa.weight": (("attn", "kv_a_proj"), Linear(1)),
    "self_attn.kv_a_layernorm.weight": (("attn", "kv_a_norm", "scale"), COPY),
    "self_attn.kv_b_proj.weight": (("attn", "kv_b_proj"), Linear(1)),
}

# A routed-expert MLP (DeepSeek-V3, GLM-4.5): router, correction bias, shared experts.
MOE_MLP = {
    "mlp.gate.weight": (("mlp", "router"), Linear(1)),
    "mlp.gate.e_score_correction_bias": (("mlp", "router_bias"), COPY),
    "mlp.shared_experts.gate_proj.weight": (("mlp", "shared", "gate_proj"), Linear(1)),
    "mlp.shared_experts.up_proj.weight": (("mlp", "shared", "up_proj"), Linear(1)),
    "mlp.shared_experts.down_proj.weight": (("mlp", "shared", "down_proj"), Linear(1)),
}

# One routed expert, released as per-expert keys `mlp.experts.{e}.` + suffix; it fills slot (layer, e).
ROUTED_EXPERT = {
    "gate_proj.weight": (("mlp", "expert_gate"), Linear(1)),
    "up_proj.weight": (("mlp", "expert_up"), Linear(1)),
    "down_proj.weight": (("mlp", "expert_down"), Linear(1)),
}

TRUNK_ROOT = {
    "model.embed_tokens.weight": (("embed",), COPY),
    "model.norm.weight": (("final_norm", "scale"), COPY),
    "lm_head.weight": (("lm_head",), Linear(1)),
}

# A head trained here with fused features (MtpConfig.fused_layers), under any layout's MTP prefix.
FEATURE_FUSION = {
    "feature_norm.weight": (("feature_norm", "scale"), COPY),
    "feature_proj.weight": (("feature_proj",), Linear(1)),
}

# MTP fusion tensors per layout: HF suffix under the MTP prefix -> (path under `mtp`, transform).
MTP_FUSION = {
    "deepseek": {
        "enorm.weight": (("token_norm", "scale"), COPY),
        "hnorm.weight": (("hidden_norm", "scale"), COPY),
        "eh_proj.weight": (("proj",), Linear(1)),
        "shared_head.norm.weight": (("final_norm", "scale"), COPY),
        # Used only when they differ from the trunk's (MtpConfig.own_embedding / own_head); else ignored below.
        "embed_tokens.weight": (("embed",), COPY),
        "shared_head.head.weight": (("head",), Linear(1)),
    },
    "qwen_next": {
        "pre_fc_norm_embedding.weight": (("token_norm", "scale"), COPY),
        "pre_fc_norm_hidden.weight": (("hidden_norm", "scale"), COPY),
        "fc.weight": (("proj",), Linear(1)),
        "norm.weight": (("final_norm", "scale"), COPY),
    },
    "mimo": {
        "token_layernorm.weight": (("token_norm", "scale"), COPY),
        "hidden_layernorm.weight": (("hidden_norm", "scale"), COPY),
        "input_proj.weight": (("proj",), Linear(1)),
        "final_layernorm.weight": (("final_norm", "scale"), COPY),
    },
}

# Tensors some checkpoints carry that this model does not read, with the reason.
IGNORED_SUFFIXES = {
    "rotary_emb.inv_freq": "recomputed from the config",
    "shared_head.head.weight": "the MTP layer shares the trunk's lm_head (the copy is identical)",
    "embed_tokens.weight": "the MTP layer shares the trunk's embedding (the copy is identical)",
}


def mtp_prefix(layout: str, num_layers: int) -> str:
    return {"deepseek": f"model.layers.{num_layers}.", "mimo": "model.mtp_layers.0.", "qwen_next": "mtp."}[layout]


def mtp_layer_prefix(layout: str, num_layers: int) -> str:
    """Where the MTP module's decoder layer sits (Qwen3-Next / 3.5: `mtp.layers.0.`, the others beside its fusion
    tensors)."""
    return "mtp.layers.0." if layout == "qwen_next" else mtp_prefix(layout, num_layers)


# Every entry of a standard decoder layer; entries whose parameter a layer lacks are skipped.
STANDARD_LAYER = {**DECODER_LAYER, **MLA_ATTENTION, **MOE_MLP}


def standard_layer_table(cfg: ModelConfig, fused_experts: bool) -> list[LayerEntry]:
    """One standard decoder layer: (HF suffix, path under the layer module, transform) entries (experts are
    per-expert keys: `ROUTED_EXPERT`)."""
    return [(suffix, path, transform) for suffix, (path, transform) in STANDARD_LAYER.items()]
