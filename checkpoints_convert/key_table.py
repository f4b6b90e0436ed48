"""Declarative key tables: Hugging Face tensor name -> (parameter path, stacked index, transform).

A transform turns the HF tensor into our layout and states the HF shape it expects, so every tensor's shape is
checked against the target parameter before it is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

from checkpoints_convert import qwen_hybrid_layout as hybrid
from mtp_jax.config import ModelConfig


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
class Transposed:
    """An HF tensor whose axes are ours permuted: ours = hf.transpose(axes) (a self-inverse permutation)."""

    axes: tuple[int, ...]

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(target[a] for a in self.axes)

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return w.transpose(self.axes)


@dataclasses.dataclass(frozen=True)
class DepthwiseConv:
    """conv1d.weight [C, 1, W] -> [W, C]."""

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return (target[1], 1, target[0])

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return hybrid.conv_weight(w)


@dataclasses.dataclass(frozen=True)
class Part:
    """Part `part` of an HF tensor of shape `shape` that holds several of our parameters; `split(w)` returns all
    of them in our layout (checkpoints_convert/qwen_hybrid_layout.py)."""

    split: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    part: int
    shape: tuple[int, ...]

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return self.shape

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return self.split(w)[self.part].reshape(target)


# Every tensor the tables below map is a floating-point weight, stored in one of these (fp8 ones dequantized on read).
WEIGHT_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
)


@dataclasses.dataclass(frozen=True)
class Target:
    path: tuple[str, ...]  # parameter path in the model's state
    index: tuple[int, ...]  # slot on the leading stacked axes: () whole, (layer,), (layer, expert)
    transform: Linear | Reshape | Transposed | DepthwiseConv | Part


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


def hybrid_layer_table(cfg: ModelConfig, fused_experts: bool) -> list[tuple[str, tuple[str, ...], object]]:
    """One layer of a Qwen3-Next / Qwen3.5 trunk (or its MTP layer): (HF suffix, path under the layer module,
    transform) entries; a suffix may fill several parameters. Entries whose parameter a layer lacks are skipped.
    Qwen3-Next fuses the DeltaNet projections (in_proj_qkvz, in_proj_ba); `fused_experts`: the experts are stored
    as `mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F] (else per expert)."""
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    gated_query = functools.partial(hybrid.gated_query, num_heads=n, head_dim=h)
    table = [
        ("input_layernorm.weight", ("input_norm", "scale"), COPY),
        ("post_attention_layernorm.weight", ("post_attention_norm", "scale"), COPY),
        ("self_attn.q_proj.weight", ("attn", "q_proj"), Part(gated_query, 0, (2 * n * h, d))),
        ("self_attn.q_proj.weight", ("attn", "gate_proj"), Part(gated_query, 1, (2 * n * h, d))),
        *((f"self_attn.{name}.weight", path, t) for name, (path, t) in _ATTENTION_REST.items()),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj"), Linear(1)),
        ("mlp.up_proj.weight", ("mlp", "up_proj"), Linear(1)),
        ("mlp.down_proj.weight", ("mlp", "down_proj"), Linear(1)),
        ("mlp.gate.weight", ("mlp", "router"), Linear(1)),
        ("mlp.shared_expert_gate.weight", ("mlp", "shared", "gate"), Linear(1)),
        *((f"mlp.shared_expert.{p}.weight", ("mlp", "shared", "mlp", p), Linear(1)) for p in _SWIGLU),
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
            qkvz = functools.partial(hybrid.fused_qkvz, cfg=deltanet)
            ba = functools.partial(hybrid.fused_ba, cfg=deltanet)
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
        gate_up = functools.partial(hybrid.fused_gate_up)
        table += [
            ("mlp.experts.gate_up_proj", ("mlp", "expert_gate"), Part(gate_up, 0, (e, 2 * f, d))),
            ("mlp.experts.gate_up_proj", ("mlp", "expert_up"), Part(gate_up, 1, (e, 2 * f, d))),
            ("mlp.experts.down_proj", ("mlp", "expert_down"), Transposed((0, 2, 1))),
        ]
    return table


_ATTENTION_REST = {
    "k_proj": (("attn", "k_proj"), Linear(1)),
    "v_proj": (("attn", "v_proj"), Linear(1)),
    "o_proj": (("attn", "o_proj"), Linear(2)),
    "q_norm": (("attn", "q_norm", "scale"), COPY),
    "k_norm": (("attn", "k_norm", "scale"), COPY),
}
_SWIGLU = ("gate_proj", "up_proj", "down_proj")

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
    "qwen_next": {
        "pre_fc_norm_embedding.weight": (("token_norm", "scale"), COPY),
        "pre_fc_norm_hidden.weight": (("hidden_norm", "scale"), COPY),
        "fc.weight": (("proj",), Linear(1)),
        "norm.weight": (("final_norm", "scale"), COPY),
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
    return {"deepseek": f"model.layers.{num_layers}.", "mimo": "model.mtp_layers.0.", "qwen_next": "mtp."}[layout]


def mtp_layer_prefix(layout: str, num_layers: int) -> str:
    """Where the MTP module's decoder layer sits (Qwen3-Next / 3.5: `mtp.layers.0.`, the others beside its fusion
    tensors)."""
    return "mtp.layers.0." if layout == "qwen_next" else mtp_prefix(layout, num_layers)


def trunk_prefix(cfg: ModelConfig) -> str:
    """The trunk's module prefix: `model.language_model.` in the Qwen3.5 VLM wrappers, `model.` otherwise."""
    return "model.language_model." if cfg.family in ("qwen3_5", "qwen3_5_moe") else "model."


# The vision tower of a VLM wrapper, by prefix, and why it is not read.
IGNORED_PREFIXES = {"model.visual.": "the vision tower (text decoding only)"}
