"""DeepSeek-V3 / R1 / V3.1 (`model_type: deepseek_v3`): config mapping.

Multi-head latent attention with query LoRA, yarn rotary (interleaved pairs, softmax mscale), sigmoid-routed
experts with group-limited top-k from layer `first_k_dense_replace` on, one MTP layer at `model.layers.{N}`
(N = num_hidden_layers). Released weights are fp8 e4m3 with 128x128 block scales (checkpoints_convert/fp8.py).
Key names: checkpoints_convert/key_table.py (MLA_ATTENTION, MOE_MLP, ROUTED_EXPERT, MTP_FUSION["deepseek"]).
"""

from __future__ import annotations

from checkpoints_convert.errors import ConversionError
from checkpoints_convert.hf_config import HANDLED_KEYS, check_common, eos_ids_from_hf, moe_from_hf, rope_from_hf
from mtp_jax.config import MlaConfig, ModelConfig, MtpConfig

MOE_KEYS = frozenset(
    {
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
        "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
    }
)  # fmt: skip

# The dense families' fields minus those these two families never have (a dense-only switch is refused).
BASE_KEYS = HANDLED_KEYS - {"mlp_bias", "use_sliding_window", "sliding_window", "layer_types"}

DEEPSEEK_KEYS = BASE_KEYS | MOE_KEYS | {
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "rope_interleave", "moe_layer_freq", "scoring_func", "topk_method",
    "aux_loss_alpha", "seq_aux", "ep_size",  # training / expert-parallel bookkeeping
}  # fmt: skip


def model_config(hf: dict) -> ModelConfig:
    check_common(hf, DEEPSEEK_KEYS)
    checks = {
        "scoring_func": (hf.get("scoring_func", "sigmoid"), "sigmoid"),
        "topk_method": (hf.get("topk_method", "noaux_tc"), "noaux_tc"),
        "moe_layer_freq": (hf.get("moe_layer_freq", 1), 1),
        "attention_bias": (bool(hf.get("attention_bias", False)), False),
    }
    for key, (value, supported) in checks.items():
        if value != supported:
            raise ConversionError(f"deepseek_v3 {key} = {value!r} is not supported (only {supported!r})")
    mla = MlaConfig(
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
    )
    num_heads = int(hf["num_attention_heads"])
    return ModelConfig(
        family="deepseek_v3",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_heads,  # MLA: every head reads the same latent
        head_dim=mla.qk_head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(hf, interleaved=bool(hf.get("rope_interleave", True))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        eos_token_ids=eos_ids_from_hf(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        mtp=MtpConfig(layout="deepseek") if int(hf.get("num_nextn_predict_layers") or 0) else None,
        mla=mla,
        moe=moe_from_hf(hf),
    )
