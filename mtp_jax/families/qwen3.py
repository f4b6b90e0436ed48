"""Qwen3 (`model_type: qwen3`): a dense grouped-query trunk with per-head q/k RMSNorm."""

from __future__ import annotations

import functools

from mtp_jax.families.base import Family, register
from mtp_jax.families.common import DENSE_TINY, dense_model_config

TINY_CONFIGS = {
    "qwen3": {
        **DENSE_TINY,
        "tie_word_embeddings": True,
        "model_type": "qwen3",
        "head_dim": 32,
        "rope_theta": 1000000.0,
        "attention_bias": False,
    },
}

FAMILY = register(
    Family(
        model_types=("qwen3",),
        model_config=functools.partial(dense_model_config, qk_norm=True),
        tiny_configs=TINY_CONFIGS,
        export_config=lambda cfg, shared: {**shared, "attention_bias": cfg.qkv_bias},
    )
)
