"""Teacher-forced MTP acceptance on given text (what `python -m mtp_jax.score` reports, and training's evaluation).

For every position p, depth 1 predicts x[p+2] from the trunk hidden h[p] and the true x[p+1]. Depth i chains
exactly as a decode round does: step i runs at position p+i-1 from step i-1's hidden and the true x[p+i], attending
to depth-1 cache entries before p+1 and to its own chain's deeper entries after. A depth-i prediction is counted
as accepted when it equals the trunk's own argmax for the same token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.models.causal_lm import CausalLM


@functools.partial(jax.jit, static_argnames=("graphdef", "depth"))
def _teacher_forced(graphdef, params, tokens, depth: int):
    model: CausalLM = nnx.merge(graphdef, params)
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    cache = model.new_cache(batch, width + depth)
    hidden, draft_hidden, _ = model.trunk_for_drafts(tokens, positions, cache)  # [B, T, D] each
    trunk_argmax = jnp.argmax(model.logits(hidden), axis=-1)  # [B, T]: the trunk's x[p+1]
    padded = jnp.concatenate([tokens, jnp.zeros((batch, depth + 1), tokens.dtype)], axis=1)  # [B, T+d+1]
    mtp_cache = model.new_mtp_cache(batch, width + depth)
    deep, normed, mtp_cache = model.mtp_step(draft_hidden, padded[:, 1 : width + 1], positions, mtp_cache)
    first = model.draft_ids(jnp.argmax(model.draft_logits(normed), axis=-1))  # [B, T]: predicts x[p+2]

    def chain(deep_p, start):  # deep_p [B, D]: depth-1 hidden at start position p
        chain_cache, predictions = mtp_cache, []
        for step in range(2, depth + 1):
            position = jnp.full((batch, 1), start + step - 1)
            true_token = jax.lax.dynamic_slice_in_dim(padded, start + step, 1, axis=1)  # [B, 1] x[p+step]
            deep_p, normed_p, chain_cache = model.mtp_step(deep_p[:, None], true_token, position, chain_cache)
            deep_p = deep_p[:, 0]
            predictions.append(model.draft_ids(jnp.argmax(model.draft_logits(normed_p[:, 0]), axis=-1)))
        return jnp.stack(predictions, axis=-1) if predictions else jnp.zeros((batch, 0), jnp.int32)

    deeper = jax.vmap(chain, in_axes=(1, 0), out_axes=1)(deep, jnp.arange(width))  # [B, T, d-1]
    return jnp.concatenate([first[..., None], deeper], axis=-1), trunk_argmax  # [B, T, d], [B, T]


def teacher_forced_predictions(model: CausalLM, tokens: np.ndarray, depth: int):
    """(MTP argmax [B, T, depth] predicting x[p+i+1] at depth i, trunk argmax [B, T] predicting x[p+1])."""
    graphdef, params = nnx.split(model)
    predictions, trunk = _teacher_forced(graphdef, params, jnp.asarray(tokens, jnp.int32), depth)
    return np.asarray(predictions), np.asarray(trunk)


def acceptance_counts(
    predictions: np.ndarray, trunk: np.ndarray, lengths: np.ndarray, starts: np.ndarray | None = None
) -> dict:
    """Per-depth agreement with the trunk's argmax: raw counts and counts given all shallower depths agreed.

    starts [B]: count only chains from slot starts - 1 on (a response starting at `starts`, where decoding's
    first round drafts from slot starts - 1); None counts every position.
    """
    _, width, depth = predictions.shape
    p = np.arange(width)
    first = np.zeros(len(lengths), int) if starts is None else np.maximum(np.asarray(starts) - 1, 0)
    agree_all = np.ones(predictions.shape[:2], bool)
    totals = {"judged": [], "agreed": [], "judged_chained": [], "agreed_chained": []}
    for i in range(depth):
        target_index = p + i + 1  # trunk prediction of x[p+i+2] sits at position p+i+1
        valid = (target_index[None, :] < lengths[:, None]) & (p[None, :] >= first[:, None])
        target = np.take_along_axis(trunk, np.minimum(target_index, width - 1)[None, :].repeat(len(trunk), 0), 1)
        agree = (predictions[..., i] == target) & valid
        totals["judged"].append(int(valid.sum()))
        totals["agreed"].append(int(agree.sum()))
        totals["judged_chained"].append(int((agree_all & valid).sum()))
        agree_all = agree_all & agree
        totals["agreed_chained"].append(int(agree_all.sum()))
    return totals


def summarize(totals: dict) -> dict:
    ratio = lambda a, b: [x / y if y else 0.0 for x, y in zip(a, b, strict=True)]
    chained = ratio(totals["agreed_chained"], totals["judged_chained"])
    expected, survive = 1.0, 1.0
    for rate in chained:
        survive *= rate
        expected += survive
    return {
        "acceptance_per_depth": ratio(totals["agreed"], totals["judged"]),
        "conditional_acceptance_per_depth": chained,
        "expected_accepted_length": expected,
        "positions_judged": totals["judged"],
    }
