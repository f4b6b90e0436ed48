"""Qwen3-MoE (`model_type: qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's grouped-query trunk (per-head q/k RMSNorm) with softmax-routed experts (models/softmax_moe.py, no shared
expert): softmax over the `num_experts` router logits, the top `num_experts_per_tok` picked, their probabilities
renormalised to sum 1 when `norm_topk_prob` (false when absent, as transformers assumes); each expert a SwiGLU of
width `moe_intermediate_size`. A layer is dense (a SwiGLU of width `intermediate_size`) where transformers makes it
so: listed in `mlp_only_layers`, or (index + 1) not a multiple of `decoder_sparse_step`. This model holds dense
layers only before the expert layers (`MoeConfig.first_dense_layers`); the released configs have none. Key names:
the standard layer table (mtp_jax/families/tables.py: `mlp.gate.weight` the router, per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight`). transformers 5 writes `num_experts` as `num_local_experts`; both
names are read.
"""

from __future__ import annotations

import numbers

from mtp_jax.config.model import ModelConfig, MoeConfig
from mtp_jax.families.base import Family, register
from mtp_jax.families.common import DENSE_TINY, HANDLED_KEYS, check_common, check_field_types, dense_model_config
from mtp_jax.runtime.errors import ConversionError

MOE_KEYS = frozenset(
    {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
     "mlp_only_layers"}
)  # fmt: skip


def dense_layer_count(hf: dict) -> int:
    """How many leading layers are dense (all of them without experts); dense layers after an expert layer are
    refused, naming them."""
    num_layers, experts = int(hf["num_hidden_layers"]), int(hf.get("num_experts") or 0)
    step, listed = int(hf.get("decoder_sparse_step") or 1), hf.get("mlp_only_layers") or []
    if not isinstance(listed, list) or not all(isinstance(i, numbers.Integral) for i in listed):
        raise ConversionError(f"mlp_only_layers must be a list of layer indices, got {listed!r}")
    dense = [i for i in range(num_layers) if not experts or i in listed or (i + 1) % step]
    if dense != list(range(len(dense))):
        shown = ", ".join(str(i) for i in dense[:8]) + (", ..." if len(dense) > 8 else "")
        raise ConversionError(
            f"qwen3_moe: dense layers [{shown}] (decoder_sparse_step {step}, mlp_only_layers {listed}) are not "
            "supported: only dense layers before every expert layer (decoder_sparse_step 1, mlp_only_layers 0..k-1)"
        )
    return len(dense)


def with_num_experts(hf: dict) -> dict:
    """`hf` with transformers 5's `num_local_experts` read as `num_experts` (both given must agree)."""
    if "num_local_experts" not in hf:
        return hf
    hf = dict(hf)
    local = hf.pop("num_local_experts")
    if hf.setdefault("num_experts", local) != local:
        raise ConversionError(f"num_experts ({hf['num_experts']!r}) and num_local_experts ({local!r}) differ")
    check_field_types(hf)
    return hf


def model_config(hf: dict) -> ModelConfig:
    hf = with_num_experts(hf)
    check_common(hf, HANDLED_KEYS | MOE_KEYS)
    first_dense = dense_layer_count(hf)
    moe = None
    if first_dense < int(hf["num_hidden_layers"]):
        moe = MoeConfig(
            num_experts=int(hf["num_experts"]),
            experts_per_token=int(hf["num_experts_per_tok"]),
            expert_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob") or False),
            first_dense_layers=first_dense,
            scoring="softmax",
        )
    trunk = {key: value for key, value in hf.items() if key not in MOE_KEYS}
    return dense_model_config(trunk, qk_norm=True, moe=moe)


def export_config(cfg: ModelConfig, shared: dict) -> dict:
    """config.json of `cfg`: the shared fields, the attention bias, the experts (none: every layer dense)."""
    m = cfg.moe
    if m is None:
        return {**shared, "attention_bias": cfg.qkv_bias, "num_experts": 0}
    experts = dict(
        num_experts=m.num_experts,
        num_experts_per_tok=m.experts_per_token,
        moe_intermediate_size=m.expert_intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(m.first_dense_layers)),
    )
    return {**shared, "attention_bias": cfg.qkv_bias, **experts}


TINY = {
    **DENSE_TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 3,
    "head_dim": 32, "rope_theta": 1000000.0, "attention_bias": False, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0],
    "num_nextn_predict_layers": 1,  # none released; a head trained here (DeepSeek layout, an expert layer)
}  # fmt: skip

FAMILY = register(
    Family(
        model_types=("qwen3_moe",),
        model_config=model_config,
        tiny_configs={"qwen3_moe": TINY},
        export_config=export_config,
    )
)
