"""Hugging Face `config.json` -> `ModelConfig`, refusing anything that changes the math and is not handled.

Every config key must be either read here or listed as harmless (bookkeeping that does not change the
forward pass). An unknown key is refused by name instead of silently ignored.
"""

from __future__ import annotations

from checkpoints_convert.errors import ConversionError
from mtp_jax.config import ModelConfig, MtpConfig, RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mimo")

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


def _rope(hf: dict) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    params.update(scaling)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ConversionError(f"rope scaling type {kind!r} is not supported (supported: default, llama3)")


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config dict of a supported dense family."""
    family = hf.get("model_type")
    if family not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"unknown model_type {family!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    unknown = sorted(set(hf) - HARMLESS_KEYS - HANDLED_KEYS)
    if unknown:
        raise ConversionError(f"{family} config has fields this converter does not handle: {', '.join(unknown)}")
    if hf.get("quantization_config"):
        raise ConversionError(f"quantized checkpoints ({hf['quantization_config']}) are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("use_sliding_window"):
        raise ConversionError("sliding-window attention (use_sliding_window: true) is not supported")
    other_layers = {t for t in (hf.get("layer_types") or []) if t != "full_attention"}
    if other_layers:
        raise ConversionError(f"layer types {sorted(other_layers)} are not supported (only full_attention)")

    num_heads = int(hf["num_attention_heads"])
    attention_bias = bool(hf.get("attention_bias", False))
    num_mtp = int(hf.get("num_nextn_predict_layers") or 0)
    if num_mtp > 1:
        raise ConversionError(f"num_nextn_predict_layers = {num_mtp}: only one MTP module is supported")
    mtp = MtpConfig(layout="mimo" if family == "mimo" else "deepseek", num_layers=1) if num_mtp else None
    is_qwen2 = family in ("qwen2", "mimo")
    return ModelConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope(hf),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        mtp=mtp,
    )
