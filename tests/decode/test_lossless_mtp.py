"""Greedy MTP speculative decoding is lossless: k drafts per round give exactly the tokens of plain greedy (k = 0)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from tests.support.prompts import MIXED_LENS as PROMPT_LENS
from tests.support.prompts import MIXED_PROMPTS as PROMPTS
from tests.support.tiny_models import predictable_model, tiny_config

NEW_TOKENS = 60
# Predictable-model seeds where, with PROMPTS, a row stops at EOS mid-batch and drafts are accepted at every depth.
SEEDS = {"deepseek": 11, "mimo": 22}


def _decode(model, ids, lens, k: int, new_tokens: int = NEW_TOKENS) -> mtp_jax.GenerateOutput:
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=new_tokens)
    return jax.tree.map(np.asarray, mtp_jax.generate(model, ids, lens, jax.random.key(0), cfg))


def _check_stats(stats, k: int) -> None:
    """The counters agree with each other (a draft is judged exactly when every earlier one was accepted)."""
    assert stats.reached[0] == stats.row_rounds
    assert stats.accepted == stats.accepted_at.sum()
    assert stats.emitted == stats.row_rounds + stats.accepted
    assert stats.drafted == k * stats.row_rounds
    np.testing.assert_array_equal(stats.reached[1:], stats.accepted_at[:-1])


@pytest.fixture(scope="module", params=["deepseek", "mimo"])
def layout(request):
    """(layout, {kind: model}, {kind: plain greedy output over PROMPTS})."""
    models = {
        "random": mtp_jax.CausalLM(tiny_config(request.param), rngs=nnx.Rngs(5)),
        "predictable": predictable_model(request.param, SEEDS[request.param]),
    }
    plain = {kind: _decode(model, PROMPTS, PROMPT_LENS, 0) for kind, model in models.items()}
    return request.param, models, plain


@pytest.mark.slow
def test_reference_stops_at_eos_mid_batch(layout):
    _, _, plain = layout
    out = plain["predictable"]
    stopped = out.finished_by_eos & (out.lengths < NEW_TOKENS)
    assert stopped.any() and (out.lengths > out.lengths[stopped].min()).any(), out.lengths
    eos = tiny_config().eos_token_ids[0]
    for row in np.flatnonzero(out.finished_by_eos):
        assert out.tokens[row, out.lengths[row] - 1] == eos
        assert not (out.tokens[row, out.lengths[row] :]).any()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("kind", ["random", "predictable"])
def test_mtp_greedy_equals_plain_greedy(layout, kind, k):
    """Batch 4 of mixed prompt lengths, then each prompt alone at batch 1."""
    _, models, plain = layout
    reference = plain[kind]
    out = _decode(models[kind], PROMPTS, PROMPT_LENS, k)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.lengths, reference.lengths)
    np.testing.assert_array_equal(out.finished_by_eos, reference.finished_by_eos)
    _check_stats(out.stats, k)
    if kind == "predictable":
        assert (out.stats.accepted_at > 0).all(), out.stats.accepted_at
    for row in range(len(PROMPT_LENS)):
        single = _decode(models[kind], PROMPTS[row : row + 1], PROMPT_LENS[row : row + 1], k)
        n = reference.lengths[row]
        assert single.lengths[0] == n, f"row {row}"
        assert single.finished_by_eos[0] == reference.finished_by_eos[row], f"row {row}"
        np.testing.assert_array_equal(single.tokens[0], reference.tokens[row], err_msg=f"row {row}")
        _check_stats(single.stats, k)


@pytest.mark.slow
def test_accepted_drafts_clipped_at_budget(layout):
    """A budget of 6 cut mid-round: exactly 6 tokens, the first 6 of plain greedy."""
    _, models, plain = layout
    budget, reference = 6, plain["predictable"]
    assert (reference.lengths > budget).all()
    out = _decode(models["predictable"], PROMPTS, PROMPT_LENS, 3, new_tokens=budget)
    np.testing.assert_array_equal(out.lengths, np.full(len(PROMPT_LENS), budget))
    np.testing.assert_array_equal(out.tokens, reference.tokens[:, :budget])
    assert not out.finished_by_eos.any()
    _check_stats(out.stats, 3)
    # The verify passes produced more tokens than were kept: some round's accepted drafts overran the budget.
    assert out.stats.emitted > (out.lengths - 1).sum()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_a_head_of_two_stacked_layers_is_lossless(k):
    """An MTP block of two decoder layers (`block_layers`, heads trained here): its [2, B, S, K, H] cache through
    the loop, drafts accepted at every depth, greedy output as plain."""
    cfg = tiny_config()
    model = predictable_model(
        "deepseek", SEEDS["deepseek"], cfg=cfg.replace(mtp=dataclasses.replace(cfg.mtp, block_layers=2))
    )
    plain = _decode(model, PROMPTS, PROMPT_LENS, 0)
    out = _decode(model, PROMPTS, PROMPT_LENS, k)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    _check_stats(out.stats, k)
    assert (out.stats.accepted_at > 0).all(), out.stats.accepted_at


@pytest.mark.parametrize("head", ["tied", "lm_head", "own"])
def test_draft_logits_over_a_vocabulary_subset_are_the_heads_columns(head):
    """Drafts over a vocabulary subset score each subset id as the full head would, whether the rows come from the
    tied embedding, an untied lm_head or the MTP layer's own head, gathered once (`draft_head`) or per call."""
    cfg = tiny_config()
    cfg = cfg.replace(
        tie_word_embeddings=head == "tied",
        mtp=dataclasses.replace(cfg.mtp, draft_vocab_size=5, own_head=head == "own"),
    )
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(3))
    ids = np.array([20, 3, 7, 0, 11], np.int32)
    model.draft_vocab[...] = jnp.asarray(ids)
    hidden = np.asarray(jax.random.normal(jax.random.key(4), (2, 3, cfg.hidden_size)))  # [B, T, D]
    if head == "own":
        weights = np.asarray(model.mtp.head[...])  # [D, V]
    elif head == "tied":
        weights = np.asarray(model.embed[...]).T
    else:
        weights = np.asarray(model.lm_head[...])
    want = np.einsum("btd,dv->btv", hidden, weights)[..., ids]  # [B, T, Vd]
    np.testing.assert_allclose(model.draft_logits(hidden), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.draft_logits(hidden, model.draft_head()), want, rtol=1e-5, atol=1e-5)
