"""GLM-4.5 / 4.6 / 4.7 (`model_type: glm4_moe`): config mapping.

Grouped-query attention with q/k/v bias (no output bias), optional per-head q/k norm, rotary over the leading half
of each head (`partial_rotary_factor`, 0.5 when absent, as transformers assumes), DeepSeek-style routed experts from
layer `first_k_dense_replace` on, one MTP layer at `model.layers.{N}` (N = num_hidden_layers; some uploads omit its
embedding and head copies: the trunk's are used). Key names: checkpoints_convert/key_table.py.
"""

from __future__ import annotations

from checkpoints_convert.deepseek_v3 import BASE_KEYS, MOE_KEYS
from checkpoints_convert.hf_config import check_common, eos_ids_from_hf, gqa_shape, moe_from_hf, rope_from_hf
from mtp_jax.config import ModelConfig, MtpConfig

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
