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


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 ids [...] of x [..., V]: the first index of a row's largest value (of its
    first NaN, where it has one), found by two plain reductions, a max and then a min over the indices that hold it.
    XLA:CPU runs argmax as one reduction over (value, index) pairs, which it does not vectorize; over a vocabulary's
    row of logits the two plain ones take a fraction of its time."""
    largest = jnp.max(x, axis=-1, keepdims=True)  # [..., 1]: NaN where the row holds one
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    holds = (x == largest) | jnp.isnan(x)  # [..., V]
    return jnp.min(jnp.where(holds, index, x.shape[-1]), axis=-1)


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
    return jnp.where(greedy, jax.nn.one_hot(first_argmax(logits), vocab, dtype=probs.dtype), probs)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw ids [...] from distributions [..., V]."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def greedy_accept(drafts: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """drafts [B, k], target logits [B, k+1, V] -> (accepted count a [B], the target's token at a [B])."""
    target = first_argmax(target_logits)  # [B, k+1]
    matches = drafts == target[:, :-1]  # [B, k]
    accepted = jnp.sum(jnp.cumprod(matches, axis=-1), axis=-1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0]


def greedy_walk(tokens: jax.Array, parents: jax.Array, hidden: jax.Array, logits_of: Callable) -> tuple:
    """Greedy acceptance of a chain or a tree, the target's logits made only along the accepted path (`logits_of`:
    hidden [B, D] -> [B, V]): from the root, each step takes the argmax at the path's end and follows the child
    holding it, while some row still finds one. tokens [B, N] the nodes' drafts, parents [B, N] each node's parent
    entry (entry 0 the root, node n entry n + 1; a chain's node n has parent n), hidden [B, N+1, D] the verify
    block's. Siblings hold distinct tokens (a parent's children are its top drafts), so the path is `greedy_accept`'s
    (a chain) or `tree.accepted_path`'s. A step's logits are a plain step's product ([B, D] rows): where a row's sums
    do not depend on the rows beside it, the tokens are those of the whole block's logits. Returns (the path's depth
    a [B], the target's token at its end [B], its end entry [B])."""
    batch = tokens.shape[0]

    def undecided(carry):
        level, _, alive, _, _ = carry
        return (level < tokens.shape[1] + 1) & jnp.any(alive)

    def next_level(carry):
        level, end, alive, accepted, token = carry  # end [B]: the path's last entry so far
        at_end = jnp.take_along_axis(hidden, end[:, None, None], axis=1)[:, 0]  # [B, D]
        pick = first_argmax(logits_of(at_end))  # [B]
        child = (parents == end[:, None]) & (tokens == pick[:, None])  # [B, N] at most one per row
        found = alive & jnp.any(child, axis=1)
        token = jnp.where(alive & ~found, pick, token)
        end = jnp.where(found, jnp.argmax(child, axis=1).astype(jnp.int32) + 1, end)
        return level + 1, end, found, accepted + found.astype(jnp.int32), token

    zeros = jnp.zeros((batch,), jnp.int32)
    start = (jnp.int32(0), zeros, jnp.ones((batch,), bool), zeros, zeros)
    _, end, _, accepted, token = jax.lax.while_loop(undecided, next_level, start)
    return accepted, token, end


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
