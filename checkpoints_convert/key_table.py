"""Declarative key tables: Hugging Face tensor name -> (parameter path, stacked index, transform).

A transform turns the HF tensor into our layout and states the HF shape it expects, so every tensor's shape is
checked against the target parameter before it is used.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Linear:
    """HF linear weight [out, in] -> our kernel `in_dims + out_dims`; `num_in` leading target dims are inputs."""

    num_in: int = 1

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(target[self.num_in :]), math.prod(target[: self.num_in]))

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return w.T.reshape(target)


@dataclasses.dataclass(frozen=True)
class Reshape:
    """A norm weight, a bias ([N*H] -> [N, H]) or an embedding: same values, our shape."""

    flat: bool = True

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(target),) if self.flat else target

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return w.reshape(target)


COPY = Reshape(flat=False)
FLAT = Reshape(flat=True)


@dataclasses.dataclass(frozen=True)
class Target:
    path: tuple[str, ...]  # parameter path in the model's state
    index: tuple[int, ...]  # slot on the leading stacked axes: () whole, (layer,), (layer, expert)
    transform: Linear | Reshape


# One decoder layer: HF suffix -> (path under the layer module, transform). Bias entries apply when present.
DECODER_LAYER = {
    "input_layernorm.weight": (("input_norm", "scale"), COPY),
    "post_attention_layernorm.weight": (("post_attention_norm", "scale"), COPY),
    "self_attn.q_proj.weight": (("attn", "q_proj"), Linear(1)),
    "self_attn.k_proj.weight": (("attn", "k_proj"), Linear(1)),
    "self_attn.v_proj.weight": (("attn", "v_proj"), Linear(1)),
    "self_attn.o_proj.weight": (("attn", "o_proj"), Linear(2)),
    "self_attn.q_proj.bias": (("attn", "q_bias"), FLAT),
    "self_attn.k_proj.bias": (("attn", "k_bias"), FLAT),
    "self_attn.v_proj.bias": (("attn", "v_bias"), FLAT),
    "self_attn.o_proj.bias": (("attn", "o_bias"), FLAT),
    "self_attn.q_norm.weight": (("attn", "q_norm", "scale"), COPY),
    "self_attn.k_norm.weight": (("attn", "k_norm", "scale"), COPY),
    "mlp.gate_proj.weight": (("mlp", "gate_proj"), Linear(1)),
    "mlp.up_proj.weight": (("mlp", "up_proj"), Linear(1)),
    "mlp.down_proj.weight": (("mlp", "down_proj"), Linear(1)),
    "mlp.gate_proj.bias": (("mlp", "gate_bias"), FLAT),
    "mlp.up_proj.bias": (("mlp", "up_bias"), FLAT),
    "mlp.down_proj.bias": (("mlp", "down_bias"), FLAT),
}

# Multi-head latent attention (DeepSeek); `self_attn.q_proj` (no query LoRA) and `self_attn.o_proj` as above.
MLA_ATTENTION = {
    "self_attn.q_a_proj.weight": (("attn", "q_a_proj"), Linear(1)),
    "self_attn.q_a_layernorm.weight": (("attn", "q_a_norm", "scale"), COPY),
    "self_attn.q_b_proj.weight": (("attn", "q_b_proj"), Linear(1)),
    "self_attn.kv_a_proj_with_mqa.weight": (("attn", "kv_a_proj"), Linear(1)),
    "self_attn.kv_a_layernorm.weight": (("attn", "kv_a_norm", "scale"), COPY),
    "self_attn.kv_b_proj.weight": (("attn", "kv_b_proj"), Linear(1)),
}

# A routed-expert MLP (DeepSeek-V3, GLM-4.5): router, correction bias, shared experts.
MOE_MLP = {
    "mlp.gate.weight": (("mlp", "router"), Linear(1)),
    "mlp.gate.e_score_correction_bias": (("mlp", "router_bias"), COPY),
    "mlp.shared_experts.gate_proj.weight": (("mlp", "shared", "gate_proj"), Linear(1)),
    "mlp.shared_experts.up_proj.weight": (("mlp", "shared", "up_proj"), Linear(1)),
    "mlp.shared_experts.down_proj.weight": (("mlp", "shared", "down_proj"), Linear(1)),
}

# One routed expert, released as per-expert keys `mlp.experts.{e}.` + suffix; it fills slot (layer, e).
ROUTED_EXPERT = {
    "gate_proj.weight": (("mlp", "expert_gate"), Linear(1)),
    "up_proj.weight": (("mlp", "expert_up"), Linear(1)),
    "down_proj.weight": (("mlp", "expert_down"), Linear(1)),
}

TRUNK_ROOT = {
    "model.embed_tokens.weight": (("embed",), COPY),
    "model.norm.weight": (("final_norm", "scale"), COPY),
    "lm_head.weight": (("lm_head",), Linear(1)),
}

# MTP fusion tensors per layout: HF suffix under the MTP prefix -> (path under `mtp`, transform).
MTP_FUSION = {
    "deepseek": {
        "enorm.weight": (("token_norm", "scale"), COPY),
        "hnorm.weight": (("hidden_norm", "scale"), COPY),
        "eh_proj.weight": (("proj",), Linear(1)),
        "shared_head.norm.weight": (("final_norm", "scale"), COPY),
        # Used only when they differ from the trunk's (MtpConfig.own_embedding / own_head); else ignored below.
        "embed_tokens.weight": (("embed",), COPY),
        "shared_head.head.weight": (("head",), Linear(1)),
    },
    "mimo": {
        "token_layernorm.weight": (("token_norm", "scale"), COPY),
        "hidden_layernorm.weight": (("hidden_norm", "scale"), COPY),
        "input_proj.weight": (("proj",), Linear(1)),
        "final_layernorm.weight": (("final_norm", "scale"), COPY),
    },
}

# Tensors some checkpoints carry that this model does not read, with the reason.
IGNORED_SUFFIXES = {
    "rotary_emb.inv_freq": "recomputed from the config",
    "shared_head.head.weight": "the MTP layer shares the trunk's lm_head (the copy is identical)",
    "embed_tokens.weight": "the MTP layer shares the trunk's embedding (the copy is identical)",
}


def mtp_prefix(layout: str, num_layers: int) -> str:
    return f"model.layers.{num_layers}." if layout == "deepseek" else "model.mtp_layers.0."
