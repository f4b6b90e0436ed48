"""What every family's config mapping shares: the fields no family needs to read (harmless bookkeeping), the
fields' JSON types checked before any family reads them, and the grouped-query shape, rotary, routed-expert and
EOS fields read alike. Each family module (mtp_jax/families/*.py) maps its own `config.json` with these.

Every config key must be either read by the family or listed as harmless (bookkeeping that does not change the
forward pass). An unknown key is refused by name instead of silently ignored.
"""

from __future__ import annotations

import math
import numbers

from mtp_jax.config.model import ModelConfig, MoeConfig, MtpConfig, RopeConfig
from mtp_jax.params.fp8 import block_size
from mtp_jax.runtime.errors import ConversionError

# Keys that never change the forward pass of an inference-only decoder.
HARMLESS_KEYS = frozenset(
    {
        "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
        "initializer_range", "use_cache", "attention_dropout", "pad_token_id", "pretraining_tp",
        "_name_or_path", "output_attentions", "output_hidden_states", "return_dict", "is_decoder",
        "tie_encoder_decoder", "chunk_size_feed_forward", "add_cross_attention", "problem_type",
        "id2label", "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
        "task_specific_params", "finetuning_task", "bad_words_ids", "begin_suppress_tokens",
        "max_window_layers", "embd_pdrop", "resid_pdrop", "summary_type", "unk_token_id",
        "generation_config", "quantization", "cross_attention_hidden_size", "is_encoder_decoder",
        "pruned_heads", "torchscript", "use_bfloat16", "tf_legacy_loss", "mtp_loss_step_weight",
        "num_mtp_loss_steps", "rope_scaling_type", "attn_implementation", "_attn_implementation_autoset",
        "use_mtp", "mlp_only_layers", "output_router_logits", "router_aux_loss_coef",
    }
)  # fmt: skip

HANDLED_KEYS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
        "attention_bias", "mlp_bias", "hidden_act", "tie_word_embeddings", "max_position_embeddings",
        "eos_token_id", "bos_token_id", "use_sliding_window", "sliding_window", "layer_types",
        "num_nextn_predict_layers", "quantization_config",
    }
)  # fmt: skip


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# What each numeric or boolean field must hold (JSON types, checked before any family reads it; the family modules
# read these names too). Null passes where a family reads the field as absent (`hf.get(key) or default`).
FIELD_RULES = (
    (
        ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
         "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
         "moe_intermediate_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
         "linear_value_head_dim", "linear_conv_kernel_dim"),
        "a positive integer",
        lambda v: _integer(v) and v > 0,
    ),
    (
        ("num_key_value_heads", "head_dim", "n_group", "topk_group", "full_attention_interval", "decoder_sparse_step"),
        "a positive integer or null",
        lambda v: v is None or (_integer(v) and v > 0),
    ),
    (
        ("intermediate_size", "qk_nope_head_dim", "q_lora_rank", "n_shared_experts", "first_k_dense_replace",
         "num_nextn_predict_layers", "mtp_num_hidden_layers", "num_experts", "shared_expert_intermediate_size"),
        "an integer >= 0 or null",
        lambda v: v is None or (_integer(v) and v >= 0),
    ),
    (("rms_norm_eps", "rope_theta", "routed_scaling_factor"), "a positive number", lambda v: _number(v) and v > 0),
    (
        ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_qk_norm", "rope_interleave", "norm_topk_prob",
         "use_sliding_window"),
        "true, false or null",
        lambda v: v is None or isinstance(v, bool),
    ),
    (("bos_token_id",), "an integer or null", lambda v: v is None or _integer(v)),
    (
        ("eos_token_id",),
        "an integer, a list of integers or null",
        lambda v: v is None or _integer(v) or (isinstance(v, list) and all(_integer(i) for i in v)),
    ),
)  # fmt: skip


def check_field_types(hf: dict, where: str = "") -> None:
    """Refuse a numeric or boolean field of the wrong type or range, by name (`where`: the prefix of nested fields)."""
    for names, wanted, valid in FIELD_RULES:
        for name in names:
            if name in hf and not valid(hf[name]):
                raise ConversionError(f"{where}{name} must be {wanted}, got {hf[name]!r}")
    if isinstance(hf.get("text_config"), dict):
        check_field_types(hf["text_config"], f"{where}text_config.")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def gqa_shape(hf: dict) -> dict:
    """The ModelConfig fields every grouped-query family reads alike: vocabulary, width, depth, heads, head_dim."""
    num_heads = int(hf["num_attention_heads"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
    )


def rope_from_hf(hf: dict, *, partial_default: float = 1.0, interleaved: bool = False) -> RopeConfig:
    """`rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older configs) -> RopeConfig."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    params.update(scaling)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", partial_default)))
    common = dict(theta=theta, partial_factor=partial, interleaved=interleaved)
    if kind == "default":
        return RopeConfig(**common)
    if kind == "llama3":
        return RopeConfig(
            **common,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
        factor = float(params.get("factor") or hf["max_position_embeddings"] / original)
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = params.get("attention_factor")
        if attention_factor is None and mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        elif attention_factor is None:
            attention_factor = _yarn_mscale(factor)
        return RopeConfig(
            **common,
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention_factor),
            mscale_all_dim=float(mscale_all_dim or 0.0),
        )
    raise ConversionError(f"rope scaling type {kind!r} is not supported (supported: default, llama3, yarn)")


def moe_from_hf(hf: dict) -> MoeConfig:
    """The routed-expert fields shared by DeepSeek-V3 and GLM-4.5 configs."""
    return MoeConfig(
        num_experts=int(hf["n_routed_experts"]),
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        num_groups=int(hf.get("n_group") or 1),
        topk_groups=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        first_dense_layers=int(hf.get("first_k_dense_replace") or 0),
    )


def check_common(hf: dict, handled: frozenset) -> None:
    """Refuse fields nobody handles and the settings no family here supports."""
    family = hf.get("model_type")
    unknown = sorted(set(hf) - HARMLESS_KEYS - handled)
    if unknown:
        raise ConversionError(f"{family} config has fields this converter does not handle: {', '.join(unknown)}")
    block_size(hf)  # refuses quantization other than block fp8 (whose weights the source dequantizes)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    num_mtp = int(hf.get("num_nextn_predict_layers") or 0)
    if num_mtp > 1:
        raise ConversionError(f"num_nextn_predict_layers = {num_mtp}: only one MTP module is supported")


def eos_ids_from_hf(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def dense_model_config(hf: dict, **family_fields) -> ModelConfig:
    """A dense grouped-query family's ModelConfig (llama, qwen2, qwen3, mimo): every field read alike, then the
    family's own (`family_fields`, e.g. `qkv_bias=True`, `qk_norm=True`) over them."""
    family = hf["model_type"]
    check_common(hf, HANDLED_KEYS)
    if hf.get("use_sliding_window"):
        raise ConversionError("sliding-window attention (use_sliding_window: true) is not supported")
    other_layers = {t for t in (hf.get("layer_types") or []) if t != "full_attention"}
    if other_layers:
        raise ConversionError(f"layer types {sorted(other_layers)} are not supported (only full_attention)")
    attention_bias = bool(hf.get("attention_bias", False))
    num_mtp = int(hf.get("num_nextn_predict_layers") or 0)
    fields = dict(
        family=family,
        **gqa_shape(hf),
        intermediate_size=int(hf["intermediate_size"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(hf),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        eos_token_ids=eos_ids_from_hf(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        mtp=MtpConfig(layout="deepseek", num_layers=1) if num_mtp else None,
    )
    return ModelConfig(**{**fields, **family_fields})


# The dense families' test size (tiny_configs start from it): vocab 256, hidden 64, 2 layers.
DENSE_TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip


def moe_to_hf(cfg: ModelConfig) -> dict:
    """The routed-expert fields of a DeepSeek-V3 / GLM-4.5 config.json (`moe_from_hf` backwards)."""
    e = cfg.moe
    return dict(
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
