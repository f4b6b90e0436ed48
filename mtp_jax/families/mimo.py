"""MiMo-7B (`model_type: mimo`, remote code): a Qwen2 trunk (q/k/v biases) and its MTP layer at
`model.mtp_layers.0.` in MiMo's own layout: the fusion concatenates [h, e] (mtp_jax/families/tables.py,
MTP_FUSION["mimo"])."""

from __future__ import annotations

from mtp_jax.config.model import ModelConfig, MtpConfig
from mtp_jax.families.base import Family, register
from mtp_jax.families.common import DENSE_TINY, dense_model_config


def model_config(hf: dict) -> ModelConfig:
    cfg = dense_model_config(hf, qkv_bias=True, o_bias=False)
    return cfg.replace(mtp=MtpConfig(layout="mimo", num_layers=1)) if cfg.has_mtp else cfg


TINY_CONFIGS = {
    "mimo": {
        **DENSE_TINY,
        "model_type": "mimo",
        "rope_theta": 640000.0,
        "num_nextn_predict_layers": 1,
        "use_sliding_window": False,
    },
}

FAMILY = register(
    Family(
        model_types=("mimo",),
        model_config=model_config,
        tiny_configs=TINY_CONFIGS,
        export_config=lambda cfg, shared: shared,
    )
)
