"""Qwen3-Next (`qwen3_next`) and Qwen3.5 / 3.6 (`qwen3_5`, `qwen3_5_moe` and their `_text` models): config mapping.

Hybrid trunks: gated DeltaNet layers ("linear_attention") and gated full-attention layers ("full_attention") in the
order `layer_types` gives (or every `full_attention_interval`-th layer full, 4 when absent), rotary on the leading
`partial_rotary_factor` (0.25) of each head, every RMSNorm with (1 + w); a dense SwiGLU (Qwen3.5) or softmax-routed
experts with a sigmoid-gated shared expert in every layer (Qwen3-Next, Qwen3.5-MoE). The VLM wrappers (`qwen3_5`,
`qwen3_5_moe`) keep the text model's config under `text_config` and its tensors under `model.language_model.`; the
vision tower is not read (text decoding only). One MTP layer: `mtp.*` (`mtp_num_hidden_layers`, 1 when absent).
Key names: checkpoints_convert/key_table.py (HYBRID_*), layouts: checkpoints_convert/qwen_hybrid_layout.py.
"""

from __future__ import annotations

from checkpoints_convert.errors import ConversionError
from checkpoints_convert.hf_config import HANDLED_KEYS, check_common, eos_ids_from_hf, gqa_shape, rope_from_hf
from mtp_jax.config import GatedDeltaNetConfig, ModelConfig, MoeConfig, MtpConfig

VLM_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # text config under `text_config`, trunk under model.language_model.
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", *VLM_MODEL_TYPES)

# The VLM wrapper's own fields: the vision tower and its special tokens do not change text decoding
# (`language_model_only`: vLLM's switch to skip the vision tower, which the text path never reads anyway).
# `quantization_config` (fp8 releases put it here) is read by the checkpoint source (checkpoints_convert/fp8.py).
VLM_KEYS = frozenset(
    {"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
     "vision_end_token_id", "tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id",
     "language_model_only", "quantization_config"}
)  # fmt: skip

HYBRID_KEYS = (HANDLED_KEYS - {"num_nextn_predict_layers", "sliding_window"}) | {
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "full_attention_interval", "partial_rotary_factor", "mtp_num_hidden_layers",
    "attn_output_gate", "mtp_use_dedicated_embeddings", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mamba_ssm_dtype",  # the dtype vLLM keeps recurrent states in; ours are float32 regardless
    "output_gate_type",  # "swish": the DeltaNet norm's silu(z) gate (Qwen3.6 configs say it; Qwen3.5 ones omit it)
}  # fmt: skip


def text_config(hf: dict) -> dict:
    """The text model's config: `text_config` of a VLM wrapper (the wrapper's tie_word_embeddings winning, its
    special token ids filling those the text config lacks), else `hf`."""
    family = hf.get("model_type")
    if family not in VLM_MODEL_TYPES:
        return hf
    bookkeeping = {"architectures", "model_type", "dtype", "torch_dtype", "transformers_version"}
    unknown = sorted(set(hf) - VLM_KEYS - bookkeeping)
    if unknown:
        raise ConversionError(f"{family} config has fields this converter does not handle: {', '.join(unknown)}")
    if not isinstance(hf.get("text_config"), dict):
        raise ConversionError(f"{family} config lacks text_config")
    text = dict(hf["text_config"])
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    for key in ("eos_token_id", "bos_token_id"):
        if text.get(key) is None and hf.get(key) is not None:
            text[key] = hf[key]
    return text


def _layer_types(hf: dict, num_layers: int) -> tuple[str, ...]:
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = int(hf.get("full_attention_interval") or 4)
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


def _moe(hf: dict, family: str) -> MoeConfig | None:
    if family in ("qwen3_5_text", "qwen3_5") or not int(hf.get("num_experts") or 0):
        return None
    if int(hf.get("decoder_sparse_step") or 1) != 1 or hf.get("mlp_only_layers"):
        raise ConversionError(f"{family}: dense layers among expert layers (decoder_sparse_step, mlp_only_layers)")
    try:
        return MoeConfig(
            num_experts=int(hf["num_experts"]),
            experts_per_token=int(hf["num_experts_per_tok"]),
            expert_intermediate_size=int(hf["moe_intermediate_size"]),
            shared_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            # Qwen3.5-MoE always renormalises the picked probabilities; Qwen3-Next when norm_topk_prob
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if family == "qwen3_next" else True,
            scoring="softmax",
        )
    except KeyError as e:
        raise ConversionError(f"{family} config lacks {e.args[0]}") from None
    except ValueError as e:
        raise ConversionError(f"{family} config: {e}") from None


def model_config(hf: dict) -> ModelConfig:
    family = hf["model_type"]
    text = text_config(hf)
    check_common(text, HYBRID_KEYS)
    if not text.get("attn_output_gate", True):
        raise ConversionError(f"{family}: attn_output_gate = false is not supported (only gated attention)")
    if text.get("mtp_use_dedicated_embeddings"):
        raise ConversionError(f"{family}: mtp_use_dedicated_embeddings = true is not supported")
    if text.get("use_sliding_window"):
        raise ConversionError(f"{family}: sliding-window attention (use_sliding_window: true) is not supported")
    if text.get("output_gate_type", "swish") != "swish":
        raise ConversionError(f"{family}: output_gate_type {text['output_gate_type']!r} is not supported (only swish)")
    num_mtp = int(text.get("mtp_num_hidden_layers", 1) or 0)
    if num_mtp > 1:
        raise ConversionError(f"mtp_num_hidden_layers = {num_mtp}: only one MTP module is supported")
    num_layers = int(text["num_hidden_layers"])
    try:
        linear = GatedDeltaNetConfig(
            num_key_heads=int(text["linear_num_key_heads"]),
            num_value_heads=int(text["linear_num_value_heads"]),
            key_head_dim=int(text["linear_key_head_dim"]),
            value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        )
        return ModelConfig(
            family=family,
            **gqa_shape(text),
            intermediate_size=int(text.get("intermediate_size") or 0),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            # Qwen3.5's rotary is an interleaved mrope; for text, all three position streams are the token's
            # position and it reduces to plain rotary on the leading partial_rotary_factor of each head.
            rope=rope_from_hf(text, partial_default=0.25),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids_from_hf(text.get("eos_token_id")),
            bos_token_id=text.get("bos_token_id"),
            mtp=MtpConfig(layout="qwen_next", recurse_normed=True) if num_mtp else None,
            moe=_moe(text, family),
            linear_attention=linear,
            layer_types=_layer_types(text, num_layers),
            gated_attention=True,
            zero_centered_norms=True,
        )
    except KeyError as e:
        raise ConversionError(f"{family} config lacks {e.args[0]}") from None
    except ValueError as e:
        raise ConversionError(f"{family} config: {e}") from None
