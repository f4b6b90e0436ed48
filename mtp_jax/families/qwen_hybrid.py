"""Qwen3-Next (`qwen3_next`) and Qwen3.5 / 3.6 (`qwen3_5`, `qwen3_5_moe` and their `_text` models).

Hybrid trunks: gated DeltaNet layers ("linear_attention") and gated full-attention layers ("full_attention") in the
order `layer_types` gives (or every `full_attention_interval`-th layer full, 4 when absent), rotary on the leading
`partial_rotary_factor` (0.25) of each head, every RMSNorm with (1 + w); a dense SwiGLU (Qwen3.5) or softmax-routed
experts with a sigmoid-gated shared expert in every layer (Qwen3-Next, Qwen3.5-MoE). The VLM wrappers (`qwen3_5`,
`qwen3_5_moe`) keep the text model's config under `text_config` and its tensors under `model.language_model.`; the
vision tower is not read (text decoding only). One MTP layer: `mtp.*` (`mtp_num_hidden_layers`, 1 when absent).
Key names: `layer_table` below; fused layouts: mtp_jax/families/qwen_hybrid_layout.py. Writing these checkpoints is
refused (fused tensors).
"""

from __future__ import annotations

import functools

from mtp_jax.config.model import GatedDeltaNetConfig, ModelConfig, MoeConfig, MtpConfig
from mtp_jax.families import qwen_hybrid_layout as layout
from mtp_jax.families.base import Family, register
from mtp_jax.families.common import HANDLED_KEYS, check_common, eos_ids_from_hf, gqa_shape, rope_from_hf
from mtp_jax.families.tables import LayerEntry
from mtp_jax.params.transforms import COPY, DepthwiseConv, Linear, Part, Transposed
from mtp_jax.runtime.errors import ConversionError

VLM_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # text config under `text_config`, trunk under model.language_model.
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", *VLM_MODEL_TYPES)

# The VLM wrapper's own fields: the vision tower and its special tokens do not change text decoding
# (`language_model_only`: vLLM's switch to skip the vision tower, which the text path never reads anyway).
# `quantization_config` (fp8 releases put it here) is read by the checkpoint source (mtp_jax/params/fp8.py).
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
    return MoeConfig(
        num_experts=int(hf["num_experts"]),
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
        shared_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        # Qwen3.5-MoE always renormalises the picked probabilities; Qwen3-Next when norm_topk_prob
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if family == "qwen3_next" else True,
        scoring="softmax",
    )


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


# The gated attention layer's projections after its fused query + gate, and a SwiGLU's.
ATTENTION_REST = {
    "k_proj": (("attn", "k_proj"), Linear(1)),
    "v_proj": (("attn", "v_proj"), Linear(1)),
    "o_proj": (("attn", "o_proj"), Linear(2)),
    "q_norm": (("attn", "q_norm", "scale"), COPY),
    "k_norm": (("attn", "k_norm", "scale"), COPY),
}
SWIGLU = ("gate_proj", "up_proj", "down_proj")


def layer_table(cfg: ModelConfig, fused_experts: bool) -> list[LayerEntry]:
    """One layer of a Qwen3-Next / Qwen3.5 trunk (or its MTP layer): (HF suffix, path under the layer module,
    transform) entries; a suffix may fill several parameters. Entries whose parameter a layer lacks are skipped.
    Qwen3-Next fuses the DeltaNet projections (in_proj_qkvz, in_proj_ba); `fused_experts`: the experts are stored
    as `mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F] (else per expert)."""
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    gated_query = functools.partial(layout.gated_query, num_heads=n, head_dim=h)
    table = [
        ("input_layernorm.weight", ("input_norm", "scale"), COPY),
        ("post_attention_layernorm.weight", ("post_attention_norm", "scale"), COPY),
        ("self_attn.q_proj.weight", ("attn", "q_proj"), Part(gated_query, 0, (2 * n * h, d))),
        ("self_attn.q_proj.weight", ("attn", "gate_proj"), Part(gated_query, 1, (2 * n * h, d))),
        *((f"self_attn.{name}.weight", path, t) for name, (path, t) in ATTENTION_REST.items()),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj"), Linear(1)),
        ("mlp.up_proj.weight", ("mlp", "up_proj"), Linear(1)),
        ("mlp.down_proj.weight", ("mlp", "down_proj"), Linear(1)),
        ("mlp.gate.weight", ("mlp", "router"), Linear(1)),
        ("mlp.shared_expert_gate.weight", ("mlp", "shared", "gate"), Linear(1)),
        *((f"mlp.shared_expert.{p}.weight", ("mlp", "shared", "mlp", p), Linear(1)) for p in SWIGLU),
    ]
    deltanet = cfg.linear_attention
    if deltanet is not None:
        table += [
            ("linear_attn.conv1d.weight", ("attn", "conv"), DepthwiseConv()),
            ("linear_attn.dt_bias", ("attn", "dt_bias"), COPY),
            ("linear_attn.A_log", ("attn", "A_log"), COPY),
            ("linear_attn.norm.weight", ("attn", "norm", "scale"), COPY),
            ("linear_attn.out_proj.weight", ("attn", "out_proj"), Linear(2)),
        ]
        if cfg.family == "qwen3_next":
            qkvz = functools.partial(layout.fused_qkvz, cfg=deltanet)
            ba = functools.partial(layout.fused_ba, cfg=deltanet)
            qkvz_shape, ba_shape = (2 * deltanet.key_dim + 2 * deltanet.value_dim, d), (2 * deltanet.num_value_heads, d)
            table += [
                ("linear_attn.in_proj_qkvz.weight", ("attn", "in_proj_qkv"), Part(qkvz, 0, qkvz_shape)),
                ("linear_attn.in_proj_qkvz.weight", ("attn", "in_proj_z"), Part(qkvz, 1, qkvz_shape)),
                ("linear_attn.in_proj_ba.weight", ("attn", "in_proj_b"), Part(ba, 0, ba_shape)),
                ("linear_attn.in_proj_ba.weight", ("attn", "in_proj_a"), Part(ba, 1, ba_shape)),
            ]
        else:
            split = ("qkv", "z", "b", "a")
            table += [(f"linear_attn.in_proj_{p}.weight", ("attn", f"in_proj_{p}"), Linear(1)) for p in split]
    if cfg.moe is not None and fused_experts:
        e, f = cfg.moe.num_experts, cfg.moe.expert_intermediate_size
        gate_up = functools.partial(layout.fused_gate_up)
        table += [
            ("mlp.experts.gate_up_proj", ("mlp", "expert_gate"), Part(gate_up, 0, (e, 2 * f, d))),
            ("mlp.experts.gate_up_proj", ("mlp", "expert_up"), Part(gate_up, 1, (e, 2 * f, d))),
            ("mlp.experts.down_proj", ("mlp", "expert_down"), Transposed((0, 2, 1))),
        ]
    return table


def trunk_prefix(cfg: ModelConfig) -> str:
    """`model.language_model.` in the Qwen3.5 VLM wrappers, `model.` otherwise."""
    return "model.language_model." if cfg.family in VLM_MODEL_TYPES else "model."


TINY = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 248056,
    "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "attn_output_gate": True, "hidden_act": "silu",
        "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [2, 1, 1]},
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "eos_token_id": 2, "bos_token_id": None,
    },
    "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "out_hidden_size": 64},
}  # fmt: skip

FAMILY = register(
    Family(
        model_types=MODEL_TYPES,
        model_config=model_config,
        tiny_configs={"qwen3_5": TINY},
        layer_table=layer_table,
        trunk_prefix=trunk_prefix,
        ignored_prefixes={"model.visual.": "the vision tower (text decoding only)"},
    )
)
