"""Logit transforms and the verification rules of speculative decoding.

Greedy: accept the longest prefix of drafts equal to the target argmax, then the target's token (bonus or
correction). Sampling: accept draft i with probability min(1, p(d_i)/q(d_i)); at the first rejection draw
from normalize(max(0, p - q)); when all k pass draw the bonus from p. p and q go through the same
temperature / top-k / top-p transforms, per row. A temperature of 0 gives one-hot distributions, for which
the sampling rule reduces exactly to the greedy rule, so a batch may mix greedy and sampled rows.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.config.decode import DecodeConfig


@struct.dataclass
class SamplingParams:
    """Per-row sampling settings. temperature [B] (0 = greedy), top_k [B] (0 = off), top_p [B] (1 = off)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def from_config(cls, cfg: DecodeConfig, batch: int) -> SamplingParams:
        return cls(
            temperature=jnp.full((batch,), cfg.temperature, jnp.float32),
            top_k=jnp.full((batch,), cfg.top_k, jnp.int32),
            top_p=jnp.full((batch,), cfg.top_p, jnp.float32),
        )


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _truncate(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """Tempered logits [B, ..., V] with the tokens outside each row's top-k and top-p set to -inf."""
    ndim, vocab = scaled.ndim, scaled.shape[-1]
    descending = -jnp.sort(-scaled, axis=-1)  # [B, ..., V]
    # top-k: keep logits >= the k-th largest.
    k = _per_row(jnp.clip(params.top_k, 0, vocab), ndim)
    kth = jnp.take_along_axis(descending, jnp.maximum(k - 1, 0), axis=-1)
    scaled = jnp.where((k > 0) & (scaled < kth), -jnp.inf, scaled)
    # top-p: keep the smallest top set whose mass reaches p (mass before a token < p).
    sorted_probs = jax.nn.softmax(jnp.where((k > 0) & (descending < kth), -jnp.inf, descending), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < _per_row(params.top_p, ndim)
    cutoff = jnp.min(jnp.where(keep_sorted, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Transformed distribution [B, ..., V] (float32) of logits [B, ..., V]; one-hot argmax for greedy rows. The
    vocabulary sort that top-k / top-p need runs only when some row of the batch truncates."""
    ndim = logits.ndim
    vocab = logits.shape[-1]
    greedy = _per_row(params.temperature <= 0, ndim)
    scaled = logits / _per_row(jnp.where(params.temperature > 0, params.temperature, 1.0), ndim)
    truncating = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    scaled = jax.lax.cond(truncating, _truncate, lambda s, _: s, scaled, params)
    probs = jax.nn.softmax(scaled, axis=-1)
    return jnp.where(greedy, jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=probs.dtype), probs)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw ids [...] from distributions [..., V]."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def greedy_accept(drafts: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """drafts [B, k], target logits [B, k+1, V] -> (accepted count a [B], the target's token at a [B])."""
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    matches = drafts == target[:, :-1]  # [B, k]
    accepted = jnp.sum(jnp.cumprod(matches, axis=-1), axis=-1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0]


def greedy_accept_row_by_row(drafts: jax.Array, hidden: jax.Array, logits_of: Callable) -> tuple[jax.Array, jax.Array]:
    """`greedy_accept`, the target's logits made one position at a time (`logits_of`: hidden [B, D] -> [B, V]) and
    only while some row has accepted every draft before it: drafts [B, k], the trunk's hiddens [B, k+1, D] -> (a [B],
    the target's token at a [B]). A position's logits are a plain step's product ([B, D] rows), so where a row's sums
    do not depend on the rows beside it the tokens are `greedy_accept`'s."""
    batch, k = drafts.shape
    # [B, k+1]: the drafts, then an id no target matches at k (the bonus position, whose target is always taken)
    past_last = jnp.concatenate([drafts, jnp.full((batch, 1), -1, jnp.int32)], axis=1)

    def undecided(carry):
        position, alive, _, _ = carry
        return (position <= k) & jnp.any(alive)

    def next_position(carry):
        position, alive, accepted, token = carry  # alive [B]: every draft before `position` accepted
        row_hidden = jax.lax.dynamic_index_in_dim(hidden, position, axis=1, keepdims=False)  # [B, D]
        target = jnp.argmax(logits_of(row_hidden), axis=-1).astype(jnp.int32)  # [B]
        matches = alive & (jax.lax.dynamic_index_in_dim(past_last, position, axis=1, keepdims=False) == target)
        token = jnp.where(alive & ~matches, target, token)
        return position + 1, matches, accepted + matches.astype(jnp.int32), token

    start = (jnp.int32(0), jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))
    _, _, accepted, token = jax.lax.while_loop(undecided, next_position, start)
    return accepted, token


def rejection_accept(
    key: jax.Array,
    drafts: jax.Array,  # [k]
    draft_probs: jax.Array,  # [k, V] q, zero outside the draft vocabulary
    target_probs: jax.Array,  # [k+1, V] p
) -> tuple[jax.Array, jax.Array]:
    """Speculative rejection sampling for one row -> (accepted count a [], the token drawn at position a [])."""
    accept_key, residual_key = jax.random.split(key)
    p_of_draft = jnp.take_along_axis(target_probs[:-1], drafts[:, None], axis=-1)[:, 0]  # [k]
    q_of_draft = jnp.take_along_axis(draft_probs, drafts[:, None], axis=-1)[:, 0]  # [k]
    passes = jax.random.uniform(accept_key, drafts.shape) * q_of_draft < p_of_draft  # P = min(1, p/q)
    accepted = jnp.sum(jnp.cumprod(passes)).astype(jnp.int32)
    p_at = target_probs[accepted]  # [V]
    q_at = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:1])])[accepted]  # zero if all k passed
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
    return accepted, sample(residual_key, residual)
