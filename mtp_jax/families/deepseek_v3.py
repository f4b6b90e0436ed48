"""DeepSeek-V3 / R1 / V3.1 (`model_type: deepseek_v3`).

Multi-head latent attention with query LoRA, yarn rotary (interleaved pairs, softmax mscale), sigmoid-routed
experts with group-limited top-k from layer `first_k_dense_replace` on, one MTP layer at `model.layers.{N}`
(N = num_hidden_layers). Released weights are fp8 e4m3 with 128x128 block scales (mtp_jax/params/fp8.py).
Key names: the standard layer table (mtp_jax/families/tables.py: MLA_ATTENTION, MOE_MLP, ROUTED_EXPERT,
MTP_FUSION["deepseek"]).
"""

from __future__ import annotations

from mtp_jax.config.model import MlaConfig, ModelConfig, MtpConfig
from mtp_jax.families.base import Family, register
from mtp_jax.families.common import HANDLED_KEYS, check_common, eos_ids_from_hf, moe_from_hf, moe_to_hf, rope_from_hf
from mtp_jax.runtime.errors import ConversionError

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


def export_config(cfg: ModelConfig, shared: dict) -> dict:
    """config.json of `cfg`: the shared fields (no head_dim: MLA's heads are sized by their parts), MLA, experts."""
    m = cfg.mla
    mla = dict(
        q_lora_rank=m.q_lora_rank or None,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=cfg.rope.interleaved,
    )
    return {**{k: v for k, v in shared.items() if k != "head_dim"}, **mla, **moe_to_hf(cfg)}


TINY = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 4,
    "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06, "hidden_act": "silu", "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "num_nextn_predict_layers": 1,
}  # fmt: skip

FAMILY = register(
    Family(
        model_types=("deepseek_v3",),
        model_config=model_config,
        tiny_configs={"deepseek_v3": TINY},
        export_config=export_config,
        published_acceptance=(0.85, "DeepSeek-V3 technical report: 85-90% acceptance of the second token"),
    )
)
