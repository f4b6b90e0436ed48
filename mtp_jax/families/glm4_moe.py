"""GLM-4.5 / 4.6 / 4.7 (`model_type: glm4_moe`).

Grouped-query attention with q/k/v bias (no output bias), optional per-head q/k norm, rotary over the leading half
of each head (`partial_rotary_factor`, 0.5 when absent, as transformers assumes), DeepSeek-style routed experts from
layer `first_k_dense_replace` on, one MTP layer at `model.layers.{N}` (N = num_hidden_layers; some uploads omit its
embedding and head copies: the trunk's are used). Key names: the standard layer table (mtp_jax/families/tables.py).
"""

from __future__ import annotations

from mtp_jax.config.model import ModelConfig, MtpConfig
from mtp_jax.families.base import Family, register
from mtp_jax.families.common import check_common, eos_ids_from_hf, gqa_shape, moe_from_hf, moe_to_hf, rope_from_hf
from mtp_jax.families.deepseek_v3 import BASE_KEYS, MOE_KEYS

GLM_KEYS = BASE_KEYS | MOE_KEYS | {"use_qk_norm", "partial_rotary_factor"}


def model_config(hf: dict) -> ModelConfig:
    check_common(hf, GLM_KEYS)
    return ModelConfig(
        family="glm4_moe",
        **gqa_shape(hf),
        intermediate_size=int(hf["intermediate_size"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope=rope_from_hf(hf, partial_default=0.5),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        eos_token_ids=eos_ids_from_hf(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        mtp=MtpConfig(layout="deepseek") if int(hf.get("num_nextn_predict_layers") or 0) else None,
        moe=moe_from_hf(hf),
    )


def export_config(cfg: ModelConfig, shared: dict) -> dict:
    return {**shared, "attention_bias": cfg.qkv_bias, "use_qk_norm": cfg.qk_norm, **moe_to_hf(cfg)}


TINY = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "partial_rotary_factor": 0.5, "attention_bias": True,
    "use_qk_norm": True, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-05, "hidden_act": "silu", "rope_theta": 1000000,
    "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": [2, 3], "num_nextn_predict_layers": 1,
}  # fmt: skip

FAMILY = register(
    Family(
        model_types=("glm4_moe",),
        model_config=model_config,
        tiny_configs={"glm4_moe": TINY},
        export_config=export_config,
    )
)
