"""Greedy MTP speculative decoding is lossless: k drafts per round give exactly the tokens of plain greedy (k = 0)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from tests.tiny_models import predictable_model, tiny_config

NEW_TOKENS = 60
PROMPT_LENS = np.array([1, 7, 4, 10], np.int32)
_raw = np.random.default_rng(0).integers(0, 24, (len(PROMPT_LENS), int(PROMPT_LENS.max())))
PROMPTS = np.where(np.arange(_raw.shape[1]) < PROMPT_LENS[:, None], _raw, 0).astype(np.int32)
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


def test_reference_stops_at_eos_mid_batch(layout):
    _, _, plain = layout
    out = plain["predictable"]
    stopped = out.finished_by_eos & (out.lengths < NEW_TOKENS)
    assert stopped.any() and (out.lengths > out.lengths[stopped].min()).any(), out.lengths
    eos = tiny_config().eos_token_ids[0]
    for row in np.flatnonzero(out.finished_by_eos):
        assert out.tokens[row, out.lengths[row] - 1] == eos
        assert not (out.tokens[row, out.lengths[row] :]).any()


@pytest.mark.parametrize("k", [1, 2, 3])
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
