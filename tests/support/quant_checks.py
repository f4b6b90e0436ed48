"""What int8 storage quantizes, written out apart from the code (the axes each output channel's scale covers), and
how far a quantized model's logits move: shared by the int8, int4 and int8-activation tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mtp_jax.quant.quantized_array import QuantizedArray
from tests.support.decode_models import PROMPT_LENS

# The weights int8 storage quantizes, by name (written out here, apart from the models' `matmul=` declarations), with
# the axes of their own shape that the matmul contracts.
QUANTIZED = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1,
             "q_a_proj": 1, "q_b_proj": 1, "kv_a_proj": 1, "kv_b_proj": 1, "in_proj_qkv": 1, "in_proj_z": 1,
             "in_proj_a": 1, "in_proj_b": 1, "out_proj": 2}  # fmt: skip
EXPERTS = ("expert_gate", "expert_up", "expert_down")  # [E, in, out]: the middle axis contracts
# int8 only: embeddings [V, D] and lm_heads [D, V], one scale per vocabulary entry (the axis that is not it).
HEADS = {("embed",): 1, ("lm_head",): 0, ("mtp", "embed"): 1, ("mtp", "head"): 0}


def contracted_axes(names: list[str], weights: str = "int8") -> tuple[int, ...] | None:
    """The axes each output channel's scale covers (None: not quantized). Layer stacks lead with one stacked axis."""
    in_block = names[0] == "segments" or names[:2] == ["mtp", "block"]
    if in_block and names[-1] in QUANTIZED:
        return tuple(range(1, 1 + QUANTIZED[names[-1]]))
    if in_block and names[-1] in EXPERTS:
        return (2,)
    if names == ["mtp", "proj"]:
        return (0,)
    if weights == "int8" and tuple(names) in HEADS:
        return (HEADS[tuple(names)],)
    return None


def logits_errors(reference, model, prompts: np.ndarray) -> np.ndarray:
    """|model's logits - reference's| over every valid prompt position, in units of the reference logits' std."""
    tokens = jnp.asarray(prompts)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = []
    for m in (reference, model):
        hidden, _ = m.trunk(tokens, positions, m.new_cache(len(tokens), 32), jnp.asarray(PROMPT_LENS))
        logits.append(np.asarray(m.logits(hidden)))
    valid = np.arange(tokens.shape[1])[None, :] < PROMPT_LENS[:, None]
    return np.abs(logits[1] - logits[0])[valid] / logits[0][valid].std()


def exact_q8_product(x: np.ndarray, weight: QuantizedArray, transposed: bool) -> np.ndarray:
    """x [M, K] by an int8 weight in blocks of 32 along K ([K, N], or [N, K] `transposed`), x rounded per block as
    `exact_product` rounds it: each block's products summed exactly as integers, then scaled in float64."""
    values = np.asarray(weight.values).astype(np.int64)
    scales = np.asarray(weight.scales).astype(np.float64)
    values, scales = (values.T, scales.T) if transposed else (values, scales)  # [K, N], [K / 32, N]
    out = np.zeros((x.shape[0], values.shape[1]))
    for b in range(scales.shape[0]):
        block = x[:, 32 * b : 32 * (b + 1)].astype(np.float32)
        d = np.max(np.abs(block), axis=1, keepdims=True) / np.float32(127)
        inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.round(block * inverse).astype(np.int64)
        out += (q @ values[32 * b : 32 * (b + 1)]) * scales[b] * d
    return out
