"""Qwen3-Next / Qwen3.5 / 3.6 tensors whose checkpoint layout is not a plain transpose of ours: the gated DeltaNet's
input projections, the gated attention's query + gate projection, fused experts.

HF stores `nn.Linear` weights as [out, in]. Canonical input projections: in_proj_qkv [D, C] with C = q of every key
head, then k of every key head, then v of every value head (value head n = key head n // G, G = N / K); in_proj_z
[D, N, Y]; in_proj_b and in_proj_a [D, N].

- Qwen3.5 / 3.6 (`linear_attn.in_proj_{qkv,z,b,a}`): already in that order, only transposed.
- Qwen3-Next (`linear_attn.in_proj_qkvz`, `linear_attn.in_proj_ba`): rows grouped by key head, each group
  [q (H), k (H), v (G*Y), z (G*Y)] and [b (G), a (G)]; regrouped here.
"""

from __future__ import annotations

import numpy as np

from mtp_jax.config.model import GatedDeltaNetConfig


def fused_qkvz(w: np.ndarray, cfg: GatedDeltaNetConfig) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next in_proj_qkvz [K*(2H + 2GY), D] -> (in_proj_qkv [D, C], in_proj_z [D, N, Y])."""
    k, h, y = cfg.num_key_heads, cfg.key_head_dim, cfg.value_head_dim
    gy = cfg.num_value_heads // k * y
    per_head = w.reshape(k, 2 * h + 2 * gy, -1)  # [K, rows of one key head, D]
    q, key, v, z = np.split(per_head, [h, 2 * h, 2 * h + gy], axis=1)
    d = w.shape[1]
    qkv = np.concatenate([q.reshape(-1, d), key.reshape(-1, d), v.reshape(-1, d)], axis=0)  # [C, D]
    return qkv.T, z.reshape(cfg.num_value_heads, y, d).transpose(2, 0, 1)


def fused_ba(w: np.ndarray, cfg: GatedDeltaNetConfig) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next in_proj_ba [K*2G, D] -> (in_proj_b [D, N], in_proj_a [D, N])."""
    groups = cfg.num_value_heads // cfg.num_key_heads
    b, a = np.split(w.reshape(cfg.num_key_heads, 2 * groups, -1), 2, axis=1)  # [K, G, D] each
    return b.reshape(cfg.num_value_heads, -1).T, a.reshape(cfg.num_value_heads, -1).T


def split_z(w: np.ndarray, cfg: GatedDeltaNetConfig) -> np.ndarray:
    """Qwen3.5 in_proj_z [N*Y, D] -> [D, N, Y] (in_proj_qkv, in_proj_b, in_proj_a: plain transposes)."""
    return w.reshape(cfg.num_value_heads, cfg.value_head_dim, -1).transpose(2, 0, 1)


def out_proj(w: np.ndarray, cfg: GatedDeltaNetConfig) -> np.ndarray:
    """out_proj.weight [D, N*Y] -> [N, Y, D] (both layouts)."""
    return w.T.reshape(cfg.num_value_heads, cfg.value_head_dim, -1)


def gated_query(w: np.ndarray, num_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Gated attention q_proj [N*2H, D] (each head: H query rows, then H gate rows) -> (q_proj, gate_proj), each
    [D, N, H]."""
    per_head = w.reshape(num_heads, 2, head_dim, -1)  # [N, query | gate, H, D]
    return per_head[:, 0].transpose(2, 0, 1), per_head[:, 1].transpose(2, 0, 1)


def fused_gate_up(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fused experts gate_up_proj [E, 2F, D] (gate rows, then up rows) -> (expert_gate, expert_up), each [E, D, F]."""
    gate, up = np.split(gate_up, 2, axis=1)
    return gate.transpose(0, 2, 1), up.transpose(0, 2, 1)


def fused_experts(gate_up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fused experts gate_up_proj [E, 2F, D] (gate rows, then up rows) and down_proj [E, D, F] -> (expert_gate
    [E, D, F], expert_up [E, D, F], expert_down [E, F, D])."""
    return (*fused_gate_up(gate_up), down.transpose(0, 2, 1))
