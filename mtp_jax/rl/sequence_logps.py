"""Log-probabilities of given tokens under a `CausalLM`, teacher-forced: what an RL learner needs of its rollout
policy beside the sampled tokens (the tokens' log-probabilities under the distribution they were drawn from)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.models.causal_lm import CausalLM

WIDTH_MULTIPLE = 64  # sequences are padded to a multiple of this, so that batches of nearby widths share a program


def compact_rows(prompt_tokens: jax.Array, completion_tokens: jax.Array, pad_id: int) -> tuple[jax.Array, jax.Array]:
    """Each row as one right-padded sequence, its prompt's left padding moved to the end: (tokens [B, P + G], the
    index of each row's first completion token [B]) from left-padded prompts [B, P] and completions [B, G]."""
    width = prompt_tokens.shape[1]
    lead = jnp.sum(jnp.cumprod(prompt_tokens == pad_id, axis=1), axis=1)  # [B] the prompt's left pads
    rows = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)  # [B, P + G]
    index = jnp.minimum(jnp.arange(rows.shape[1])[None, :] + lead[:, None], rows.shape[1] - 1)
    return jnp.take_along_axis(rows, index, axis=1), width - lead


def sequence_logps(model: CausalLM, tokens: jax.Array, starts: jax.Array, length: int,
                   temperature: jax.Array | float = 1.0) -> jax.Array:  # fmt: skip
    """log p(tokens[b, starts[b] + j] | what precedes it) for j < `length` [B, length], under the model's next-token
    distribution at `temperature` (logits divided by it; 0 is read as 1: greedy tokens are scored untempered).
    `tokens` [B, T] right-padded; positions past a row's end score whatever follows there (mask them)."""
    graphdef, state = nnx.split(model)
    width = -(-(tokens.shape[1] + 1) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    padded = jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    return _sequence_logps(graphdef, state, padded, starts, jnp.float32(temperature), length=length)


@functools.partial(jax.jit, static_argnames=("graphdef", "length"))
def _sequence_logps(graphdef, state, tokens, starts, temperature, *, length: int):
    model = nnx.merge(graphdef, state)
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    hidden, _ = model.trunk(tokens, positions, model.new_cache(batch, width))  # [B, T, D]
    at = jnp.minimum(starts[:, None] - 1 + jnp.arange(length)[None, :], width - 2)  # [B, G] predicting positions
    hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)  # [B, G, D]
    scale = jnp.where(temperature > 0, temperature, 1.0)
    logps = jax.nn.log_softmax(model.logits(hidden) / scale, axis=-1)  # [B, G, V]
    targets = jnp.take_along_axis(tokens, at + 1, axis=1)  # [B, G]
    return jnp.take_along_axis(logps, targets[..., None], axis=-1)[..., 0]
