"""Hybrid trunks (gated DeltaNet + gated attention) under speculative decoding: the recurrent states roll back by
replay, so MTP greedy gives exactly plain greedy's tokens, with chains and with draft trees; and the state a row keeps
after a verify block (a chain's, or a tree's along its accepted path) is the state plain (chunked) prefill reaches
over the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.config import execution_plan
from mtp_jax.kernels import traced_plan
from mtp_jax.models.block_tree import BlockTree
from mtp_jax.models.gated_deltanet import DeltaNetState
from mtp_jax.models.hybrid_stack import RecurrentForm
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


@pytest.mark.parametrize(("depth", "budget", "width"), [(3, 8, 3), (4, 12, 2)])
def test_greedy_tree_equals_plain_greedy(model, plain, depth, budget, width):
    """Each node's DeltaNet state in the verify pass is a chain's over its path; the accepted path's is replayed."""
    cfg = mtp_jax.DecodeConfig(num_draft=depth, tree=budget, tree_width=width, max_new_tokens=NEW_TOKENS)
    out = jax.tree.map(np.asarray, mtp_jax.generate(model, PROMPTS, PROMPT_LENS, jax.random.key(0), cfg))
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_array_equal(out.finished_by_eos, plain.finished_by_eos)
    assert out.stats.tree_rounds == out.stats.rounds
    assert (out.stats.accepted_at > 0).all(), out.stats.accepted_at  # paths to every depth were accepted
    assert out.stats.accepted_at[-1] < out.stats.accepted_at[0]  # and paths ended short of the tree's depth


@pytest.mark.skipif(
    not execution_plan.invariant_trees(traced_plan.resolve(invariant=True)),
    reason="batch-invariant trees need the CPU row kernel",
)
def test_bfloat16_trees_under_batch_invariant_decoding_give_plain_tokens_at_any_batch(model):
    """bfloat16, batch-invariant: a tree's nodes (each DeltaNet state a chain's over its path, the attention layers
    through the CPU kernel's tree mask) give plain decoding's tokens, for the batch and for rows decoded alone."""
    graphdef, state = nnx.split(model)
    cast = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x
    half = nnx.merge(graphdef, jax.tree.map(cast, state))

    def decode(rows, **settings):
        cfg = mtp_jax.DecodeConfig(max_new_tokens=60, invariant=True, **settings)
        out = mtp_jax.generate(half, PROMPTS[rows], PROMPT_LENS[rows], jax.random.key(0), cfg)
        return jax.tree.map(np.asarray, out)

    every = slice(None)
    plain = decode(every, num_draft=0)
    tree = decode(every, num_draft=3, tree=8, tree_width=3)
    np.testing.assert_array_equal(tree.tokens, plain.tokens)
    assert tree.stats.accepted_at[1] > 0
    for row in (1, 3):
        alone = decode(slice(row, row + 1), num_draft=3, tree=8, tree_width=3)
        np.testing.assert_array_equal(alone.tokens[0], plain.tokens[row])


def test_adaptive_draft_length_is_lossless(model, plain):
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=NEW_TOKENS, adaptive=True)
    out = jax.tree.map(np.asarray, mtp_jax.generate(model, PROMPTS, PROMPT_LENS, jax.random.key(0), cfg))
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)


def _deltanet_states(cache: tuple) -> list[DeltaNetState]:
    """Every DeltaNet state of a trunk cache (a tuple of segment caches)."""
    groups = [segment for segment in cache if isinstance(segment, GroupCache)]
    return [entry for group in groups for entry in group.members if isinstance(entry, DeltaNetState)]


def _assert_prefill_states(model, before, kept, appended: np.ndarray, accepted, slots: int) -> None:
    """Rows 0-2 of `kept` (trunk caches) hold the DeltaNet states a chunked prefill of each prompt plus its first
    accepted[b] + 1 `appended` [B, A] tokens reaches; row 3 (inactive) holds its state in `before` exactly."""
    width = PROMPTS.shape[1] + appended.shape[1]
    extended = np.zeros((len(PROMPT_LENS), width), np.int32)
    for row, n in enumerate(PROMPT_LENS):
        extended[row, :n] = PROMPTS[row, :n]
        extended[row, n : n + appended.shape[1]] = appended[row]
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
        _, verified = model.trunk(tokens, block_positions, cache, recurrent=RecurrentForm.EVERY_STATE)
        return cache, model.keep_verified(cache, verified, accepted, active)

    before, kept = run(PROMPTS, PROMPT_LENS, tokens)
    _assert_prefill_states(model, before, kept, tokens, accepted, slots)


TREE_PARENTS = (0, 0, 0, 1, 1, 2, 4, 3)  # entries 1, 2 under the root; 3, 4 under 1; 5 under 2; 6 under 4; 7 under 3
TREE_PATHS = ((0, 0, 0, 0), (0, 2, 5, 0), (0, 1, 4, 6), (0, 1, 3, 7))  # each row's accepted path, by depth


def test_kept_state_after_a_tree_block_equals_prefill_of_its_path(model):
    """Prefill the prompts, verify a tree block of 8 entries (every DeltaNet entry as the last token of its path),
    keep each row's accepted path (row 0 accepts none; row 3 inactive: its old state): each DeltaNet state equals a
    chunked prefill of the prompt plus the path's tokens."""
    slots, entries = 32, len(TREE_PARENTS)
    tokens = np.random.default_rng(2).integers(0, 24, (len(PROMPT_LENS), entries)).astype(np.int32)
    accepted, active = jnp.array([0, 2, 3, 3]), jnp.array([True, True, True, False])
    tree = BlockTree.of(jnp.broadcast_to(jnp.array(TREE_PARENTS, jnp.int32), tokens.shape), 3)
    path = jnp.array(TREE_PATHS, jnp.int32)

    @jax.jit
    def run(prompts, lens, tokens):
        positions = jnp.broadcast_to(jnp.arange(prompts.shape[1]), prompts.shape)
        _, cache = model.trunk(prompts, positions, model.new_cache(len(lens), slots), lengths=lens)
        block_positions = lens[:, None] + tree.depths
        _, verified = model.trunk(tokens, block_positions, cache, recurrent=RecurrentForm.EVERY_STATE, block_tree=tree)
        return cache, model.keep_verified(cache, verified, accepted, active, path)

    before, kept = run(PROMPTS, PROMPT_LENS, tokens)
    path_tokens = np.take_along_axis(tokens, np.array(TREE_PATHS), axis=1)
    _assert_prefill_states(model, before, kept, path_tokens, accepted, slots)
