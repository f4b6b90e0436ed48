"""The acceptance rules by themselves, on synthetic distributions (no model, no decode loop): greedy acceptance
against a loop written out here, and speculative rejection sampling's emitted tokens against the target
distributions, from many independent draws; and one verify pass of a tiny trunk against plain decoding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.decode.round_timing import prefilled_state
from mtp_jax.decode.rounds import Round, RoundKind, round_context, verify
from mtp_jax.decode.sampling import first_argmax, greedy_accept, greedy_walk, rejection_accept
from mtp_jax.models.kv_cache import cache_slots
from tests.support.tiny_models import tiny_config

VOCAB = 6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_first_argmax_is_numpys_argmax_with_ties_infinities_and_nans(dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 40, 700)).astype(np.float32)
    x = np.round(x * 4) / 4  # many ties of the largest value
    x[0, 1] = -np.inf
    x[0, 2, 5] = x[0, 2, 600] = np.inf
    x[0, 3, [9, 400]] = np.nan
    x[0, 4] = np.nan
    x[0, 5, 699] = 50.0  # the last index
    got = np.asarray(first_argmax(jnp.asarray(x, dtype)))
    expected = np.asarray(x.astype(jnp.dtype(dtype))).argmax(-1)  # numpy: the first largest, or the first NaN
    assert got.dtype == np.int32 and got.shape == (3, 40)
    np.testing.assert_array_equal(got, expected)
    assert got[0, 1] == 0 and got[0, 2] == 5 and got[0, 3] == 9 and got[0, 4] == 0 and got[0, 5] == 699


def test_greedy_accepts_the_longest_agreeing_prefix_then_the_targets_token():
    rng = np.random.default_rng(0)
    batch, k = 256, 3
    logits = rng.normal(size=(batch, k + 1, VOCAB)).astype(np.float32)
    target = logits.argmax(-1)
    agree = rng.random((batch, k)) < 0.7
    drafts = np.where(agree, target[:, :k], (target[:, :k] + rng.integers(1, VOCAB, (batch, k))) % VOCAB)
    accepted, token = (np.asarray(x) for x in greedy_accept(jnp.asarray(drafts), jnp.asarray(logits)))
    expected = np.zeros(batch, int)
    for b in range(batch):
        while expected[b] < k and drafts[b, expected[b]] == target[b, expected[b]]:
            expected[b] += 1
    np.testing.assert_array_equal(accepted, expected)
    np.testing.assert_array_equal(token, target[np.arange(batch), expected])
    assert {0, 1, k} <= set(expected.tolist())  # rows rejected at once, part way and never


@pytest.mark.parametrize("batch", [1, 2, 64])
def test_greedy_acceptance_row_by_row_is_the_blocks(batch):
    """The target's logits made a position at a time, only while some row still accepts, give the block's verdict;
    the positions after every row's rejection are never made."""
    rng = np.random.default_rng(batch)
    k, width = 3, 8
    hidden = rng.normal(size=(batch, k + 1, width)).astype(np.float32)  # [B, k+1, D]
    head = rng.normal(size=(width, VOCAB)).astype(np.float32)  # [D, V]
    target = (hidden @ head).argmax(-1)  # [B, k+1]
    agree = rng.random((batch, k)) < 0.6
    drafts = np.where(agree, target[:, :k], (target[:, :k] + rng.integers(1, VOCAB, (batch, k))) % VOCAB)
    made = []

    def logits_of(rows):  # [B, D] -> [B, V], counting the positions made
        jax.debug.callback(lambda: made.append(1))
        return rows @ jnp.asarray(head)

    chain = jnp.broadcast_to(jnp.arange(k), (batch, k))  # draft i's parent: entry i
    lazily = jax.jit(functools.partial(greedy_walk, logits_of=logits_of))
    accepted, token, end = (np.asarray(x) for x in lazily(jnp.asarray(drafts, jnp.int32), chain, jnp.asarray(hidden)))
    np.testing.assert_array_equal(end, accepted)  # a chain's path ends at the entry of its last accepted draft
    block = greedy_accept(jnp.asarray(drafts, jnp.int32), jnp.asarray(hidden @ head))
    np.testing.assert_array_equal(accepted, np.asarray(block[0]))
    np.testing.assert_array_equal(token, np.asarray(block[1]))
    jax.effects_barrier()
    assert len(made) == min(k, accepted.max()) + 1  # up to the deepest row's first rejection (or the bonus)


def emitted_frequencies(p: np.ndarray, q: np.ndarray, draws: int, seed: int):
    """Drafts drawn from q ([k, V]; a synthetic row's target p [k+1, V] does not depend on them) and judged by
    `rejection_accept`: per position i, (how often a round emits a token at i, the frequencies of the tokens it
    emits there), and the frequency of a first draft accepted."""
    k = q.shape[0]
    draft_keys, accept_keys = jax.random.split(jax.random.key(seed), 2)
    drafts = jax.random.categorical(draft_keys, jnp.log(jnp.asarray(q)), shape=(draws, k)).astype(jnp.int32)
    keys = jax.random.split(accept_keys, draws)
    accepted, token = jax.vmap(rejection_accept, in_axes=(0, 0, None, None))(keys, drafts, jnp.asarray(q),
                                                                             jnp.asarray(p))  # fmt: skip
    drafts, accepted, token = np.asarray(drafts), np.asarray(accepted), np.asarray(token)
    per_position = []
    for i in range(k + 1):
        reached = accepted >= i  # a round emits a token at i when its first i drafts were accepted
        emitted = np.where(accepted[reached] > i, drafts[reached, min(i, k - 1)], token[reached])
        per_position.append((reached.sum(), np.bincount(emitted, minlength=VOCAB) / max(reached.sum(), 1)))
    return per_position, (accepted >= 1).mean()


def assert_close(frequencies: np.ndarray, probabilities: np.ndarray, n: int, what: str):
    """Every token's frequency within 5 standard errors of its probability (about 1 in 10^6 per comparison)."""
    tolerance = 5 * np.sqrt(probabilities * (1 - probabilities) / n) + 1e-9
    assert np.all(np.abs(frequencies - probabilities) <= tolerance), (what, frequencies, probabilities)


def test_rejection_sampling_emits_the_targets_distribution_at_every_position():
    """Drafts from q, judged against p: the token a round emits at each position is distributed as that position's
    target p, whether it is an accepted draft, a token drawn from the residual or the bonus token after k drafts; a
    first draft is accepted with probability sum(min(p, q)). q leaves out tokens p has (a draft vocabulary) and p
    leaves out tokens q proposes. (A rejection that draws from p itself instead of the residual fails this.)"""
    p = np.array([
        [0.40, 0.25, 0.20, 0.10, 0.05, 0.00],
        [0.05, 0.05, 0.50, 0.20, 0.00, 0.20],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    ])  # fmt: skip
    q = np.array([[0.10, 0.50, 0.20, 0.00, 0.00, 0.20], [0.20, 0.00, 0.30, 0.30, 0.20, 0.00]])
    per_position, first_accepted = emitted_frequencies(p, q, draws=200_000, seed=0)
    for i, (reached, frequencies) in enumerate(per_position):
        assert reached > 20_000
        assert_close(frequencies, p[i], reached, f"position {i}")
    acceptance = np.minimum(p[0], q[0]).sum()
    assert abs(first_accepted - acceptance) <= 5 * np.sqrt(acceptance * (1 - acceptance) / 200_000)


def test_a_draft_equal_to_the_target_is_always_accepted():
    """q = p: every draft passes (the uniform draw times q is below p), and the bonus token comes from p[k]."""
    p = np.array([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0], [0.0, 0.1, 0.1, 0.8, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.6, 0.4]])
    per_position, first_accepted = emitted_frequencies(p, p[:2], draws=20_000, seed=1)
    assert first_accepted == 1.0
    assert [reached for reached, _ in per_position] == [20_000] * 3
    assert_close(per_position[2][1], p[2], 20_000, "bonus")


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def verdict(graphdef, params, state, drafts, cfg: mtp_jax.DecodeConfig):
    """`rounds.verify` of `drafts` [B, j] from a loop state: (accepted [B], the target's token after them [B])."""
    model = nnx.merge(graphdef, params)
    round_ = Round(RoundKind.DRAFT, drafts.shape[1])
    ctx = round_context(model, cfg, None, jnp.zeros((0,), jnp.int32), [round_])
    judged = verify(ctx, state, drafts, None, state.cache)
    return judged.accepted, judged.token


@pytest.mark.slow  # compiles a tiny model's prefill, verify pass and plain decoding
def test_verify_accepts_what_plain_decoding_emits_and_no_more():
    """One verify pass of the trunk over [pending, d_1..d_3] from the prefilled state: each row accepts exactly the
    drafts equal to plain decoding's next tokens, up to the first that differs, and its own token is plain
    decoding's at that position (prompts of two lengths)."""
    model = mtp_jax.CausalLM(tiny_config(vocab=40, eos=()), rngs=nnx.Rngs(3))
    ids, lens = np.array([[5, 6, 7, 8], [9, 10, 11, 0], [12, 13, 0, 0]], np.int32), np.array([4, 3, 2], np.int32)
    plain_cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=6, stop_on_eos=False)
    plain = np.asarray(mtp_jax.generate(model, ids, lens, jax.random.key(0), plain_cfg).tokens)  # [B, 6]
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=6, stop_on_eos=False)
    graphdef, params = nnx.split(model)
    state = prefilled_state(graphdef, params, ids, lens, cfg, cache_slots(ids.shape[1], cfg))
    np.testing.assert_array_equal(np.asarray(state.pending), plain[:, 0])
    wrong = (plain + 1) % 40
    drafts = np.stack([
        [plain[0, 1], plain[0, 2], wrong[0, 3]],  # two accepted
        [wrong[1, 1], plain[1, 2], plain[1, 3]],  # none: the later agreeing drafts do not count
        plain[2, 1:4],  # all three
    ]).astype(np.int32)  # fmt: skip
    accepted, token = (np.asarray(x) for x in verdict(graphdef, params, state, jnp.asarray(drafts), cfg))
    np.testing.assert_array_equal(accepted, [2, 0, 3])
    np.testing.assert_array_equal(token, [plain[0, 3], plain[1, 1], plain[2, 4]])
