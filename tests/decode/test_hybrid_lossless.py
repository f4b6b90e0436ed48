"""Hybrid trunks (gated DeltaNet + gated attention) under speculative decoding: the recurrent states roll back by
replay, so MTP greedy gives exactly plain greedy's tokens; and the state a row keeps after a verify block is the
state plain (chunked) prefill reaches over the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.models.gated_deltanet import DeltaNetState
from mtp_jax.models.kv_cache import GroupCache
from tests.support.hybrid_models import predictable_hybrid_model
from tests.support.prompts import padded_prompts

pytestmark = pytest.mark.slow

NEW_TOKENS = 200
PROMPT_LENS = np.array([1, 7, 4, 10], np.int32)
PROMPTS = padded_prompts(0, PROMPT_LENS, 24)
SEED = 6  # with PROMPTS: rows stop at EOS after 27, 21 and 1 tokens, one runs the full budget


@pytest.fixture(scope="module")
def model():
    return predictable_hybrid_model(SEED)


@pytest.fixture(scope="module")
def plain(model):
    return _decode(model, 0)


def _decode(model, k: int) -> mtp_jax.GenerateOutput:
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=NEW_TOKENS)
    return jax.tree.map(np.asarray, mtp_jax.generate(model, PROMPTS, PROMPT_LENS, jax.random.key(0), cfg))


def test_model_is_a_grouped_hybrid(model, plain):
    """Six layers as one scanned group (DeltaNet, DeltaNet, gated attention) repeated twice; the reference stops at
    EOS mid-batch and runs a row to the full budget."""
    (segment,) = model.config.segments()
    assert segment.count == 2 and [k.attention for k in segment.kinds] == ["deltanet", "deltanet", "gated"]
    assert plain.finished_by_eos.any() and (plain.lengths == NEW_TOKENS).any()
    assert (plain.lengths[plain.finished_by_eos] < NEW_TOKENS).all()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_plain_greedy(model, plain, k):
    out = _decode(model, k)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_array_equal(out.finished_by_eos, plain.finished_by_eos)
    # drafts were accepted at every depth and rejected in many rounds (rollback by replay was exercised)
    assert (out.stats.accepted_at > 0).all(), out.stats.accepted_at
    assert out.stats.accepted_at[0] < 0.8 * out.stats.row_rounds, (out.stats.accepted_at, out.stats.row_rounds)


def test_adaptive_draft_length_is_lossless(model, plain):
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=NEW_TOKENS, adaptive=True)
    out = jax.tree.map(np.asarray, mtp_jax.generate(model, PROMPTS, PROMPT_LENS, jax.random.key(0), cfg))
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)


def _deltanet_states(cache: tuple) -> list[DeltaNetState]:
    """Every DeltaNet state of a trunk cache (a tuple of segment caches)."""
    groups = [segment for segment in cache if isinstance(segment, GroupCache)]
    return [entry for group in groups for entry in group.members if isinstance(entry, DeltaNetState)]


def test_kept_state_after_a_verify_block_equals_prefill_state(model):
    """Prefill the prompts, verify a block of 4 tokens (recurrent form, its inputs kept), keep position
    accepted[b] (row 3 inactive: its old state): each DeltaNet state equals a chunked prefill of the prompt plus the
    accepted[b] + 1 block tokens."""
    slots, block = 32, 4
    tokens = np.random.default_rng(1).integers(0, 24, (len(PROMPT_LENS), block)).astype(np.int32)
    accepted, active = jnp.array([0, 3, 1, 2]), jnp.array([True, True, True, False])

    @jax.jit
    def run(prompts, lens, tokens):
        positions = jnp.broadcast_to(jnp.arange(prompts.shape[1]), prompts.shape)
        _, cache = model.trunk(prompts, positions, model.new_cache(len(lens), slots), lengths=lens)
        block_positions = lens[:, None] + jnp.arange(block)
        _, verified = model.trunk(tokens, block_positions, cache, recurrent="every_state")
        return cache, model.keep_verified(cache, verified, accepted, active)

    before, kept = run(PROMPTS, PROMPT_LENS, tokens)
    width = PROMPTS.shape[1] + block
    extended = np.zeros((len(PROMPT_LENS), width), np.int32)
    for row, n in enumerate(PROMPT_LENS):
        extended[row, :n] = PROMPTS[row, :n]
        extended[row, n : n + block] = tokens[row]
    grown = jnp.asarray(PROMPT_LENS) + accepted + 1
    positions = jnp.broadcast_to(jnp.arange(width), extended.shape)
    _, reference = jax.jit(model.trunk)(extended, positions, model.new_cache(len(grown), slots), lengths=grown)
    for got, want, old in zip(
        _deltanet_states(kept), _deltanet_states(reference), _deltanet_states(before), strict=True
    ):
        for name in ("conv", "recurrent"):
            got_a, want_a, old_a = (np.asarray(getattr(s, name)) for s in (got, want, old))
            np.testing.assert_allclose(got_a[:, :3], want_a[:, :3], rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(got_a[:, 3], old_a[:, 3])  # inactive row: exactly its old state
