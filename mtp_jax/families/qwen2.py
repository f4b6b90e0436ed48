"""Qwen2 / Qwen2.5 (`model_type: qwen2`): a dense grouped-query trunk with q/k/v biases (no output bias)."""

from __future__ import annotations

import functools

from mtp_jax.families.base import Family, register
from mtp_jax.families.common import DENSE_TINY, dense_model_config

FAMILY = register(
    Family(
        model_types=("qwen2",),
        model_config=functools.partial(dense_model_config, qkv_bias=True, o_bias=False),
        tiny_configs={
            "qwen2": {**DENSE_TINY, "model_type": "qwen2", "rope_theta": 1000000.0, "use_sliding_window": False},
        },
        export_config=lambda cfg, shared: shared,
    )
)
