"""`generate_chunks`: `generate` run in pieces gives `generate`'s output, and every piece a prefix of it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import mtp_jax
from tests.support.prompts import padded_prompts
from tests.support.tiny_models import predictable_model

NEW_TOKENS = 40
PROMPT_LENS = np.array([1, 7, 4, 10], np.int32)
PROMPTS = padded_prompts(0, PROMPT_LENS, 24)


@pytest.fixture(scope="module")
def model():
    return predictable_model("deepseek", 11)  # with PROMPTS: a row stops at EOS mid-batch, drafts accepted


def host(tree):
    return jax.tree.map(np.asarray, tree)


def check_pieces(pieces, whole, chunk: int) -> None:
    """The last piece is `whole`; each earlier one holds a prefix of every row, at least `chunk` more tokens per
    piece for the rows that go on."""
    np.testing.assert_equal(jax.tree.leaves(host(pieces[-1])), jax.tree.leaves(host(whole)))
    for i, piece in enumerate(pieces[:-1], start=1):
        lengths = np.asarray(piece.lengths)
        assert (lengths >= np.minimum(i * chunk, np.asarray(whole.lengths))).all(), (i, lengths)
        assert (lengths <= np.asarray(whole.lengths)).all()
        for row, n in enumerate(lengths):
            np.testing.assert_array_equal(np.asarray(piece.tokens)[row, :n], np.asarray(whole.tokens)[row, :n])
    assert len(pieces) > 1


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_greedy_pieces_add_up_to_generate(model, k):
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=NEW_TOKENS)
    key = jax.random.key(0)
    whole = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, cfg)
    stopped = np.asarray(whole.finished_by_eos) & (np.asarray(whole.lengths) < NEW_TOKENS)
    assert stopped.any() and not stopped.all()  # EOS mid-batch
    pieces = list(mtp_jax.generate_chunks(model, PROMPTS, PROMPT_LENS, key, cfg, chunk_tokens=7))
    check_pieces(pieces, whole, 7)


@pytest.mark.slow
def test_sampled_and_adaptive_pieces_add_up_to_generate(model):
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=5, adaptive=True)
    key = jax.random.key(3)
    whole = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, cfg)
    pieces = list(mtp_jax.generate_chunks(model, PROMPTS, PROMPT_LENS, key, cfg, chunk_tokens=5))
    check_pieces(pieces, whole, 5)


@pytest.mark.slow
def test_a_lone_invariant_row_in_pieces(model):
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=NEW_TOKENS, invariant=True)
    ids, lens, key = PROMPTS[1:2], PROMPT_LENS[1:2], jax.random.key(0)
    whole = mtp_jax.generate(model, ids, lens, key, cfg)
    pieces = list(mtp_jax.generate_chunks(model, ids, lens, key, cfg, chunk_tokens=9))
    check_pieces(pieces, whole, 9)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_a_bad_chunk_size_is_refused(model, chunk):
    with pytest.raises(ValueError, match="chunk_tokens"):
        next(mtp_jax.generate_chunks(model, PROMPTS, PROMPT_LENS, jax.random.key(0), chunk_tokens=chunk))
