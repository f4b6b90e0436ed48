"""Keeping an MTP head fresh while its trunk trains (RL post-training): as the policy moves, a head trained on the old
trunk drafts what the old trunk would have said, and acceptance falls. `refresh_head` updates the head alone from
what the rollouts already computed: their tokens and the current trunk's hidden states over them (`rollout_batch`,
or the learner's own forward pass), with the head training's losses (training/head_training.py).

It is a pure function of the model, an optax state and a batch: jittable (inside a user's `jax.jit` or `nnx.jit`),
and it returns a new model. The trunk's parameters go in frozen and come out as they went in; no gradient is taken
with respect to them, so the policy's own update is untouched. A constant learning rate (no schedule): the refresh
runs for as long as the policy trains.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.training.head_training import Batch, draft_target_index, loss_weights, split_trainable, step_losses

AGREEMENT_OBJECTIVE = "tv"  # 1 - sum min(p, q): what sampled verification at temperature 1 rejects


@dataclasses.dataclass(frozen=True)
class RefreshConfig:
    """num_steps: the recursive MTP steps in the objective (a decode round's depth); objective: "kl" to the current
    trunk's distribution (the default: every position a whole distribution to match), "ce" or "tv"
    (head_training.py)."""

    num_steps: int = 3
    objective: str = "kl"
    learning_rate: float = 1e-4
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    beta: float = 0.6

    def optimizer(self) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(self.grad_clip),
            optax.adamw(self.learning_rate, weight_decay=self.weight_decay),
        )


def init_refresh(model: CausalLM, cfg: RefreshConfig = RefreshConfig()) -> optax.OptState:
    """The optimizer state of the model's MTP head (its parameters under `mtp`)."""
    _, head, _ = split_trainable(model)
    return cfg.optimizer().init(head)


def refresh_head(model: CausalLM, opt_state: optax.OptState, batch: Batch, cfg: RefreshConfig = RefreshConfig()):
    """One optimizer step of the MTP head on `batch` (rollout tokens [B, T], the current trunk's final hiddens
    [B, T, D], lengths, where each response starts, and the fused layers' outputs for a head that reads them):
    (the model with the new head, the new optimizer state, {"loss", "acc" [K] per recursive step})."""
    graphdef, head, frozen = split_trainable(model)
    head, opt_state, metrics = _refresh(graphdef, head, frozen, opt_state, batch, cfg)
    return nnx.merge(graphdef, head, frozen), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def _refresh(graphdef, head, frozen, opt_state, batch: Batch, cfg: RefreshConfig):
    weights = jnp.asarray(loss_weights(cfg.num_steps, cfg.beta))
    target_index = draft_target_index(nnx.merge(graphdef, head, frozen))

    def objective(head):
        model = nnx.merge(graphdef, head, frozen)
        losses, accuracies, _ = step_losses(model, batch, cfg.num_steps, target_index, cfg.objective)
        return jnp.sum(weights * losses), accuracies

    (loss, accuracies), grads = jax.value_and_grad(objective, has_aux=True)(head)
    updates, opt_state = cfg.optimizer().update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, {"loss": loss, "acc": accuracies}


def rollout_batch(model: CausalLM, tokens: jax.Array, lengths: jax.Array, response_starts: jax.Array) -> Batch:
    """A refresh batch from rollouts (prompt + sampled answer, tokens [B, T] right-padded, lengths [B], the first
    answer position of each row [B]): the current trunk's hiddens over them, and the fused layers' outputs where the
    head reads some, computed here (one compiled pass) with no gradient."""
    graphdef, state = nnx.split(model)
    return _rollout_batch(graphdef, state, tokens, lengths, response_starts)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _rollout_batch(graphdef, state, tokens, lengths, response_starts) -> Batch:
    model = nnx.merge(graphdef, state)
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    taps = model.config.mtp.fused_layers if model.config.has_mtp else ()
    hidden, tapped = model.trunk_taps(tokens, positions, model.new_cache(batch, 1), taps)
    hidden, tapped = jax.lax.stop_gradient((hidden, tapped))
    return Batch(tokens=tokens, hidden=hidden, lengths=lengths, loss_start=response_starts, taps=tapped)


def draft_agreement(model: CausalLM, batch: Batch, num_steps: int = 1) -> dict:
    """How well the model's head drafts for its trunk on `batch` (from `rollout_batch`), teacher-forced, per depth
    [num_steps]: "expected" acceptance of sampled drafts at temperature 1 (1 - the total variation between the trunk's
    next-token distribution and the head's, both over the draft vocabulary) and "argmax" (the head's argmax is the
    batch's own next-next token: greedy acceptance on greedy text), and the answer "positions" each depth's means
    are over. Scores a head on answers it did not draft."""
    graphdef, state = nnx.split(model)
    rejection, argmax, positions = _agreement(graphdef, state, batch, num_steps)
    return {
        "expected": (1.0 - np.asarray(rejection)).tolist(),
        "argmax": np.asarray(argmax).tolist(),
        "positions": np.asarray(positions).tolist(),
    }


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps"))
def _agreement(graphdef, state, batch: Batch, num_steps: int):
    model = nnx.merge(graphdef, state)
    return step_losses(model, batch, num_steps, draft_target_index(model), AGREEMENT_OBJECTIVE)


def with_head(model: CausalLM, head: nnx.State) -> CausalLM:
    """`model`'s trunk with another head of the same shapes (an MTP state from `split_trainable`, e.g. the head as
    it was before its refreshes)."""
    graphdef, _, trunk = split_trainable(model)
    return nnx.merge(graphdef, head, trunk)
