"""Llama (`model_type: llama`; SmolLM2, the default model, is one): a dense grouped-query trunk, optional attention
and MLP biases, llama3 rotary scaling. Released checkpoints have no MTP layer; a DeepSeek-layout one trained here
(`num_nextn_predict_layers: 1`) is read at `model.layers.{N}`."""

from __future__ import annotations

from mtp_jax.config.model import ModelConfig
from mtp_jax.families.base import Family, register
from mtp_jax.families.common import DENSE_TINY, dense_model_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def export_config(cfg: ModelConfig, shared: dict) -> dict:
    return {**shared, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}


TINY_CONFIGS = {
    "llama": {
        **DENSE_TINY,
        "model_type": "llama",
        "head_dim": 16,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_parameters": LLAMA3_ROPE,
    },
    "llama-with-mtp-head": {
        **DENSE_TINY,
        "model_type": "llama",
        "head_dim": 16,
        "rope_theta": 10000.0,
        "num_nextn_predict_layers": 1,
    },
}

FAMILY = register(
    Family(
        model_types=("llama",),
        model_config=dense_model_config,
        tiny_configs=TINY_CONFIGS,
        export_config=export_config,
    )
)
