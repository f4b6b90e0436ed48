"""The head refresh (training/head_refresh.py) against what it is for: a trunk moved away from its head (its layers'
outputs amplified, so its next token is no longer the bigram the head drafts) loses acceptance on its own answers;
a few refresh steps on those answers bring it back, and leave every trunk parameter bit for bit as it was. The
agreement score (`draft_agreement`) against the decode's own passes, computed by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax
from mtp_jax.training.acceptance import acceptance_counts, teacher_forced_predictions
from mtp_jax.training.head_refresh import (
    RefreshConfig,
    draft_agreement,
    init_refresh,
    refresh_head,
    rollout_batch,
    with_head,
)
from mtp_jax.training.head_training import split_trainable
from tests.support.prompts import padded_prompts
from tests.support.tiny_models import predictable_model

PROMPT_LENS = np.array([3, 5, 2, 4, 6, 3, 1, 4], np.int32)
ANSWER = 24


def _moved_trunk() -> mtp_jax.CausalLM:
    """The predictable model with its trunk layers' outputs amplified: what an RL update does to a head's trunk."""
    model = predictable_model(seed=0)
    layers = model.segments[0].layers
    layers.attn.o_proj[...] = layers.attn.o_proj[...] * 8.0
    layers.mlp.down_proj[...] = layers.mlp.down_proj[...] * 8.0
    return model


def _rollouts(model, seed: int):
    """Greedy answers of the policy: tokens [B, P + ANSWER] (prompt then answer), lengths, answer starts."""
    prompts = padded_prompts(seed, PROMPT_LENS, model.config.vocab_size)
    cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=ANSWER, stop_on_eos=False)
    out = mtp_jax.generate(model, prompts, PROMPT_LENS, jax.random.key(seed), cfg)
    width = prompts.shape[1] + ANSWER
    tokens = np.zeros((len(PROMPT_LENS), width), np.int32)
    for row, n in enumerate(PROMPT_LENS):
        tokens[row, :n] = np.asarray(prompts)[row, :n]
        tokens[row, n : n + ANSWER] = np.asarray(out.tokens)[row]
    return jnp.asarray(tokens), jnp.asarray(PROMPT_LENS + ANSWER), jnp.asarray(PROMPT_LENS)


def _first_draft_acceptance(model, tokens, lengths, starts) -> float:
    predictions, trunk = teacher_forced_predictions(model, np.asarray(tokens), depth=1)
    totals = acceptance_counts(predictions, trunk, np.asarray(lengths), np.asarray(starts))
    return totals["agreed"][0] / totals["judged"][0]


def test_a_refreshed_head_follows_its_moved_trunk_and_leaves_the_trunk_alone():
    fresh = predictable_model(seed=0)
    before = _first_draft_acceptance(fresh, *_rollouts(fresh, seed=1))
    model = _moved_trunk()
    held_out = _rollouts(model, seed=2)
    stale = _first_draft_acceptance(model, *held_out)
    assert stale < before - 0.2, (before, stale)  # the moved trunk's answers are not the head's bigrams

    cfg = RefreshConfig(learning_rate=3e-3, num_steps=2)
    opt_state = init_refresh(model, cfg)
    _, head_before, trunk_before = split_trainable(model)
    refreshed = model
    for step in range(40):
        batch = rollout_batch(refreshed, *_rollouts(refreshed, seed=10 + step % 4))
        refreshed, opt_state, metrics = refresh_head(refreshed, opt_state, batch, cfg)
    assert np.all(np.isfinite(np.asarray(metrics["loss"])))
    recovered = _first_draft_acceptance(refreshed, *held_out)
    assert recovered > stale + 0.2, (stale, recovered)

    _, head_after, trunk_after = split_trainable(refreshed)
    for a, b in zip(jax.tree.leaves(trunk_before), jax.tree.leaves(trunk_after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(head_before), jax.tree.leaves(head_after), strict=True)
    )


def test_the_refresh_runs_inside_a_users_jit():
    """One refresh step traced inside `nnx.jit` (as an RL step would call it) equals the step called eagerly."""
    model = _moved_trunk()
    cfg = RefreshConfig(learning_rate=1e-3, num_steps=2)
    batch = rollout_batch(model, *_rollouts(model, seed=3))
    eager, _, eager_metrics = refresh_head(model, init_refresh(model, cfg), batch, cfg)
    step = nnx.jit(lambda m, o, b: refresh_head(m, o, b, cfg))
    jitted, _, jitted_metrics = step(model, init_refresh(model, cfg), batch)
    np.testing.assert_allclose(np.asarray(jitted_metrics["loss"]), np.asarray(eager_metrics["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(eager)), jax.tree.leaves(nnx.state(jitted)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _agreement_by_hand(model, tokens, lengths, starts) -> tuple[float, float]:
    """Depth 1 through the decode's passes (`trunk_for_drafts`, `mtp_step`, `draft_logits`), in NumPy: the mean over
    answer slots s (x[s+2] in the answer) of sum min(p, q), p the trunk's distribution of x[s+2] over the draft
    vocabulary, q the head's; and how often the head's argmax is x[s+2]."""
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    hidden, draft_hidden, _ = model.trunk_for_drafts(tokens, positions, model.new_cache(batch, width))
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], axis=1)
    _, normed, _ = model.mtp_step(draft_hidden, next_tokens, positions, model.new_mtp_cache(batch, width))
    q = np.asarray(jax.nn.softmax(model.draft_logits(normed), axis=-1))  # [B, T, Vd]: x[s+2] from slot s
    vocab = np.arange(q.shape[-1]) if model.draft_vocab is None else np.asarray(model.draft_vocab[...])
    p = np.asarray(jax.nn.softmax(model.logits(hidden)[..., vocab], axis=-1))  # [B, T, Vd]: x[s+1] from slot s
    drafted = vocab[q.argmax(-1)]
    tokens, overlaps, hits = np.asarray(tokens), [], []
    for row in range(batch):
        for s in range(width - 2):
            if int(starts[row]) <= s + 2 < int(lengths[row]):
                overlaps.append(np.minimum(p[row, s + 1], q[row, s]).sum())
                hits.append(drafted[row, s] == tokens[row, s + 2])
    return float(np.mean(overlaps)), float(np.mean(hits))


def test_draft_agreement_scores_a_head_as_the_decode_passes_draft():
    scores = {}
    for name, model in (("fresh", predictable_model(seed=0)), ("moved", _moved_trunk())):
        rollouts = _rollouts(model, seed=4)
        batch = rollout_batch(model, *rollouts)
        scored = draft_agreement(model, batch)
        expected, argmax = _agreement_by_hand(model, *rollouts)
        np.testing.assert_allclose(scored["expected"], [expected], rtol=1e-5)
        np.testing.assert_allclose(scored["argmax"], [argmax], rtol=1e-6)
        deeper = draft_agreement(model, batch, num_steps=3)  # depth 1 does not depend on the deeper steps
        assert len(deeper["expected"]) == 3 and np.isclose(deeper["expected"][0], expected, rtol=1e-5)
        scores[name] = expected
    assert scores["moved"] < scores["fresh"] - 0.2, scores  # the moved trunk's answers are not the head's bigrams


def test_with_head_keeps_the_trunk_and_takes_the_other_head():
    model, other = _moved_trunk(), predictable_model(seed=7)
    _, head, trunk = split_trainable(with_head(model, split_trainable(other)[1]))
    want = (split_trainable(other)[1], split_trainable(model)[2])
    for a, b in zip(jax.tree.leaves((head, trunk)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(split_trainable(model)[1]), strict=True)
    )
