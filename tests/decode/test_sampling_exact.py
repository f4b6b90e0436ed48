"""Speculative sampling keeps plain sampling's distribution exactly.

A tiny model with a 6-token vocabulary: the exact probability of every 5-token continuation of one prompt is the
product of the trunk's transformed conditionals (enumerated over all 6^4 prefixes, transforms re-implemented here in
numpy). One `generate` call decodes blocks of rows, each block with its own temperature / top-k / top-p (plus a
greedy block), and each block's empirical joint distribution of the 5 tokens is compared with its exact one by a
chi-square test (cells with an expected count below 5 pooled) and by total variation.

The test can fail. With the rule mutated (a patched copy run on the same seeds and rows; the correct rule gives
p-values 0.011 to 0.85 and marginal TV <= 0.017 over the five blocks at k = 3):
  - residual p instead of normalize(max(0, p - q)) at the first rejection:  p-value 1e-102 (k = 1), 1e-153 (k = 3)
                                                                             in the first block, TV 0.10
  - the bonus after k accepts drawn from normalize(max(0, p - q_k)), not p:  k = 1: p-value 2e-303, TV 0.11;
                                                                             k = 3: p-value 9e-5 .. 0.75 per block,
                                                                             TV up to 0.035
  - drafts by argmax of q (q still used in the acceptance ratio):           p-value 0, TV 0.23-0.24
Draft trees (decode/tree.py: a draw from the target at every node, the walk following the child equal to it): with
one key for every node of a round instead of one each, p-value 0 and TV 0.13 (tree 8 of width 3, and tree 5 of width
2 over a draft vocabulary of 4) in the first block. The first two rules are also checked alone, on synthetic
distributions, by tests/decode/test_acceptance_rules.py, which fails under either mutation in seconds.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats

import mtp_jax
from mtp_jax.decode.sampling import SamplingParams
from tests.support.hybrid_models import hybrid_config
from tests.support.tiny_models import tiny_config

pytestmark = pytest.mark.slow

VOCAB = 6
NEW_TOKENS = 5  # the first from prefill, then rounds of k drafts: every verify position and the bonus are covered
PROMPT = np.array([1, 4, 2], np.int32)
ROWS_PER_BLOCK = 6_000
# (temperature, top_k, top_p) per block; a greedy block rides along in the same batch.
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.8), (1.2, 4, 0.9)]
HYBRID_SETTINGS = [SETTINGS[0], SETTINGS[-1]]  # the slower hybrid trunk: plain temperature, and all three transforms
GREEDY_ROWS = 16


def make_model(draft_vocab_size: int = 0, hybrid: bool = False) -> mtp_jax.CausalLM:
    """Random weights with a scaled-up embedding, so the conditionals are peaked (top token ~0.7) and differ.
    `hybrid`: a Qwen3.5-shaped trunk (gated DeltaNet and gated attention layers; recurrent states roll back by
    selection) instead of the dense one."""
    base = hybrid_config(vocab=VOCAB, eos=(), num_layers=3) if hybrid else tiny_config(vocab=VOCAB, eos=())
    cfg = base.replace(max_position_embeddings=64)
    cfg = cfg.replace(mtp=dataclasses.replace(cfg.mtp, draft_vocab_size=draft_vocab_size))
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(3))
    model.embed[...] = model.embed[...] * 4.0
    if draft_vocab_size:
        model.draft_vocab[...] = jnp.array([1, 2, 4, 5][:draft_vocab_size], jnp.int32)  # q is 0 on 0 and 3
    return model


def reference_probabilities(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Plain sampling's distributions [N, V] (float64) for logits [N, V]: temperature, then top-k, then top-p."""
    scaled = logits.astype(np.float64) / temperature
    descending = -np.sort(-scaled, axis=-1)
    if top_k:
        scaled = np.where(scaled >= descending[:, top_k - 1 : top_k], scaled, -np.inf)  # ties with the k-th stay
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    sorted_probs = -np.sort(-probs, axis=-1)
    count = 1 + np.sum(np.cumsum(sorted_probs, axis=-1)[:, :-1] < top_p, axis=-1)  # smallest top set reaching p
    probs = np.where(probs >= sorted_probs[np.arange(len(probs)), count - 1][:, None], probs, 0.0)
    return probs / probs.sum(axis=-1, keepdims=True)


PREFIXES = np.array(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS - 1)), np.int32)  # [V^4, 4]


def next_token_logits(model) -> np.ndarray:
    """The trunk's logits [V^4, 5, V] for the token after PROMPT + each prefix's first 0..4 tokens."""
    ids = np.concatenate([np.broadcast_to(PROMPT, (len(PREFIXES), len(PROMPT))), PREFIXES], axis=1)  # [N, P+4]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    hidden, _ = model.trunk(jnp.asarray(ids), positions, model.new_cache(len(ids), 1))
    return np.asarray(model.logits(hidden[:, len(PROMPT) - 1 :]), np.float64)


def exact_distribution(logits: np.ndarray, settings) -> np.ndarray:
    """P(t_1..t_5 | PROMPT) for every continuation: [V ** NEW_TOKENS], index = base-V digits t_1 t_2 ..."""
    prefixes = PREFIXES
    joint = np.ones(len(prefixes))
    conditionals = np.stack([reference_probabilities(logits[:, step], *settings) for step in range(NEW_TOKENS)], 1)
    for step in range(NEW_TOKENS - 1):
        joint *= conditionals[np.arange(len(prefixes)), step, prefixes[:, step]]
    return (joint[:, None] * conditionals[:, -1]).reshape(-1)  # prefix-major, last token minor


def chi_square_p_value(samples: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of token rows [N, T] against cell probabilities over the V^T sequences."""
    cells = samples @ (VOCAB ** np.arange(samples.shape[1] - 1, -1, -1))
    observed = np.bincount(cells, minlength=len(probs)).astype(np.float64)
    expected = len(samples) * probs
    assert observed[expected == 0].sum() == 0, "sampled a sequence of probability zero"
    big = expected >= 5
    observed = np.append(observed[big], observed[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    statistic = np.sum((observed - expected) ** 2 / expected)
    return float(scipy_stats.chi2.sf(statistic, len(observed) - 1))


def marginal_total_variation(samples: np.ndarray, probs: np.ndarray) -> float:
    """The largest total variation, over positions, between the sampled and exact one-token marginals."""
    joint = probs.reshape((VOCAB,) * samples.shape[1])
    distances = []
    for step in range(samples.shape[1]):
        exact = joint.sum(axis=tuple(a for a in range(samples.shape[1]) if a != step))
        sampled = np.bincount(samples[:, step], minlength=VOCAB) / len(samples)
        distances.append(0.5 * np.abs(sampled - exact).sum())
    return max(distances)


# The adaptive case's costs make its policy draft 3 in the first round and rest (plain steps without the MTP layer)
# in the others.
# k = 2 runs on the hybrid trunk: the same exactness with rejected drafts rolled back in recurrent states; so does a
# tree of depth 2 (each node's state a chain's over its path).
# Draft trees (num_draft its depth; (node budget, width)): a branchy one, and one over the draft vocabulary's subset;
# adaptive with a tree: its first round a tree's, then rests.
@pytest.mark.parametrize(
    ("num_draft", "draft_vocab_size", "round_costs", "hybrid", "tree"),
    [
        (0, 0, None, False, None), (1, 0, None, False, None), (2, 0, None, True, None), (3, 0, None, False, None),
        (3, 4, None, False, None), (3, 0, (1.0, 1.5, 1.6, 1.7), False, None), (3, 0, None, False, (8, 3)),
        (2, 4, None, False, (5, 2)), (3, 0, (1.0, 1.5, 1.6, 1.7, 1.75), False, (8, 3)), (2, 0, None, True, (5, 2)),
    ],
)  # fmt: skip
def test_speculative_sampling_matches_exact_distribution(num_draft, draft_vocab_size, round_costs, hybrid, tree):
    model = make_model(draft_vocab_size, hybrid)
    transforms = HYBRID_SETTINGS if hybrid else SETTINGS
    blocks = [*transforms, (0.0, 0, 1.0)]
    sizes = [ROWS_PER_BLOCK] * len(transforms) + [GREEDY_ROWS]
    per_row = lambda column, dtype: jnp.asarray(np.repeat([b[column] for b in blocks], sizes), dtype)
    sampling = SamplingParams(temperature=per_row(0, jnp.float32), top_k=per_row(1, jnp.int32),
                              top_p=per_row(2, jnp.float32))  # fmt: skip
    batch = sum(sizes)
    ids, lens = np.broadcast_to(PROMPT, (batch, len(PROMPT))), np.full(batch, len(PROMPT), np.int32)
    adaptive = round_costs is not None
    tree_budget, tree_width = tree or (0, 4)
    cfg = mtp_jax.DecodeConfig(num_draft=num_draft, max_new_tokens=NEW_TOKENS, adaptive=adaptive,
                               round_costs=round_costs, tree=tree_budget, tree_width=tree_width)  # fmt: skip
    out = mtp_jax.generate(model, ids, lens, jax.random.key(num_draft), cfg, sampling)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert (lengths == NEW_TOKENS).all()
    if adaptive:
        rounds_with = np.asarray(out.stats.rounds_with)
        assert rounds_with[0] > 0 and rounds_with[num_draft] > 0, rounds_with  # plain and full rounds both ran
        assert int(out.stats.rests) > 0
        assert (int(out.stats.tree_rounds) > 0) == bool(tree), int(out.stats.tree_rounds)
    if num_draft:
        reached, accepted = np.asarray(out.stats.reached), np.asarray(out.stats.accepted_at)
        often = 0.05 if tree else 0.2  # a tree's budget keeps few deep nodes
        assert (accepted > often * reached).all(), (reached, accepted)  # every depth is accepted and rejected often
        assert (accepted < 0.8 * reached).all(), (reached, accepted)

    logits = next_token_logits(model)
    start = 0
    for settings, size in zip(blocks, sizes, strict=True):
        block = tokens[start : start + size]
        start += size
        if settings[0] == 0:
            plain = dataclasses.replace(cfg, num_draft=0, adaptive=False, round_costs=None, tree=0)
            greedy = mtp_jax.generate(model, ids[:1], lens[:1], jax.random.key(0), plain)
            np.testing.assert_array_equal(block, np.broadcast_to(np.asarray(greedy.tokens), block.shape))
            continue
        probs = exact_distribution(logits, settings)
        p_value, distance = chi_square_p_value(block, probs), marginal_total_variation(block, probs)
        assert p_value > 1e-3 and distance < 0.03, (settings, p_value, distance)
