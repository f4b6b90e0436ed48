"""Draft trees are lossless: greedy decoding with a tree gives plain greedy's tokens (k = 0) on every family's tiny
config (hybrid trunks also in tests/decode/test_hybrid_lossless.py), mixed prompt lengths, EOS mid-batch, budgets that
end inside a tree; the committed caches hold the values a plain prefill of the same tokens writes; the accepted path
is the walk a reference in Python takes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.config import execution_plan
from mtp_jax.decode import speculative
from mtp_jax.decode.prefill import prefill
from mtp_jax.decode.rounds import Round, RoundKind, draft, round_context
from mtp_jax.decode.sampling import greedy_walk
from mtp_jax.decode.tree import accepted_path, draft_tree
from mtp_jax.families.registry import model_config_from_hf, tiny_configs
from mtp_jax.kernels import traced_plan
from mtp_jax.models.block_tree import BlockTree
from mtp_jax.models.kv_cache import cache_slots
from tests.support.prompts import MIXED_LENS as PROMPT_LENS
from tests.support.prompts import MIXED_PROMPTS as PROMPTS
from tests.support.tiny_models import predictable_model, predictable_moe_model

NEW_TOKENS = 40
SEED = 11  # the predictable GQA model of test_lossless_mtp: a row stops at EOS mid-batch


def _decode(model, ids, lens, new_tokens: int = NEW_TOKENS, **settings) -> mtp_jax.GenerateOutput:
    cfg = mtp_jax.DecodeConfig(max_new_tokens=new_tokens, **settings)
    return jax.tree.map(np.asarray, mtp_jax.generate(model, ids, lens, jax.random.key(0), cfg))


def _assert_same(out, plain) -> None:
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.finished_by_eos, plain.finished_by_eos)


def _check_stats(stats, budget: int) -> None:
    """The counters agree with each other: every round judges depth 1, a depth is judged where the one above it was
    accepted, and each row-round offers the whole tree."""
    assert stats.reached[0] == stats.row_rounds
    assert stats.accepted == stats.accepted_at.sum()
    assert stats.emitted == stats.row_rounds + stats.accepted
    assert stats.drafted == budget * stats.row_rounds
    np.testing.assert_array_equal(stats.reached[1:], stats.accepted_at[:-1])


@pytest.fixture(scope="module")
def predictable():
    model = predictable_model("deepseek", SEED)
    return model, _decode(model, PROMPTS, PROMPT_LENS, num_draft=0)


@pytest.mark.parametrize(("depth", "budget", "width"), [(3, 3, 1), (3, 8, 2), (3, 8, 3), (4, 16, 4), (2, 20, 4)])
def test_greedy_tree_equals_plain(predictable, depth, budget, width):
    """A width of 1 is the chain; (2, 20, 4): 20 of the 24 tokens proposed at every node."""
    model, plain = predictable
    out = _decode(model, PROMPTS, PROMPT_LENS, num_draft=depth, tree=budget, tree_width=width)
    stopped = plain.finished_by_eos & (plain.lengths < NEW_TOKENS)
    assert stopped.any() and not stopped.all()  # EOS mid-batch
    _assert_same(out, plain)
    _check_stats(out.stats, budget)
    assert out.stats.accepted_at[1] > 0  # paths past depth 1 are accepted


def test_a_tree_accepts_more_than_its_chain(predictable):
    """Same depth: the tree's other branches hold what the chain's first choices miss (so paths through a node that
    is not its parent's likeliest child are accepted)."""
    model, _ = predictable
    chain = _decode(model, PROMPTS, PROMPT_LENS, num_draft=3)
    tree = _decode(model, PROMPTS, PROMPT_LENS, num_draft=3, tree=8, tree_width=2)
    per_round = lambda out: out.stats.emitted / out.stats.row_rounds
    assert per_round(tree) > per_round(chain) + 0.2, (per_round(tree), per_round(chain))


def test_a_budget_past_what_the_tree_proposes_is_refused(predictable):
    model, _ = predictable  # 24 draft tokens: depth 1 proposes 24 nodes at most, depth 2 width 1 48
    with pytest.raises(ValueError, match="proposes 24 nodes, fewer than its budget of 30"):
        speculative.checked_decode_config(model, mtp_jax.DecodeConfig(num_draft=1, tree=30, tree_width=2))
    speculative.checked_decode_config(model, mtp_jax.DecodeConfig(num_draft=2, tree=30, tree_width=1))


def test_a_tree_holds_its_chain(predictable):
    """The chain of the tree's depth (each depth's likeliest draft) is among the tree's nodes, parent by parent,
    however flat the head's probabilities (this head's first choices are right far more often than they say, so
    ranked by path probability alone the tree would hold the root's children and nothing deeper)."""
    model, _ = predictable
    cfg = mtp_jax.DecodeConfig(num_draft=3, tree=6, tree_width=2, max_new_tokens=NEW_TOKENS)
    slots, eos = cache_slots(PROMPTS.shape[1], cfg), jnp.zeros((0,), jnp.int32)
    keys = jax.random.split(jax.random.key(0), PROMPTS.shape[0])
    state = prefill(model, cfg, None, eos, PROMPTS, PROMPT_LENS, keys, slots)
    ctx = round_context(model, cfg, None, eos, [Round(RoundKind.TREE, 3, 6)])
    chain = np.asarray(draft(ctx, Round(RoundKind.DRAFT, 3), state).tokens)  # [B, 3]
    tree = draft_tree(ctx, state)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)  # [B, N], block entries (0: the root)
    for row in range(PROMPTS.shape[0]):
        entry = 0
        for token in chain[row]:
            children = [i + 1 for i in range(tokens.shape[1]) if parents[row, i] == entry]
            matching = [i for i in children if tokens[row, i - 1] == token]
            assert len(matching) == 1, (row, chain[row], tokens[row], parents[row])
            entry = matching[0]
    assert (parents > 0).sum() < parents.size  # the budget left over holds other children of the root


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 5, 6])
def test_budgets_that_end_inside_a_tree(predictable, new_tokens):
    model, _ = predictable
    plain = _decode(model, PROMPTS, PROMPT_LENS, new_tokens, num_draft=0)
    _assert_same(_decode(model, PROMPTS, PROMPT_LENS, new_tokens, num_draft=3, tree=8, tree_width=3), plain)


def _family_model(family: str):
    cfg = model_config_from_hf(tiny_configs()[family])
    return mtp_jax.CausalLM(cfg.replace(eos_token_ids=(5,)), rngs=nnx.Rngs(4))


MTP_FAMILIES = sorted(name for name, hf in tiny_configs().items() if model_config_from_hf(hf).has_mtp)


@pytest.mark.slow
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_every_family(family):
    """Random tiny configs of every family with an MTP head (GQA with and without biases and q/k norms, partial
    rotary, latent attention, routed experts, hybrid gated DeltaNet and gated attention trunks)."""
    model = _family_model(family)
    ids = PROMPTS % model.config.vocab_size
    plain = _decode(model, ids, PROMPT_LENS, 24, num_draft=0)
    out = _decode(model, ids, PROMPT_LENS, 24, num_draft=3, tree=10, tree_width=3)
    _assert_same(out, plain)
    _check_stats(out.stats, 10)


@pytest.mark.slow
def test_latent_attention_with_experts_accepts_deep_paths():
    """A predictable DeepSeek-V3 (MLA and routed experts in trunk and MTP layer): the tree's MTP passes and verify
    attend their latents through the tree mask, and paths past depth 1 are accepted."""
    model = predictable_moe_model("deepseek_v3", seed=2)
    ids = PROMPTS % model.config.vocab_size
    plain = _decode(model, ids, PROMPT_LENS, 24, num_draft=0)
    out = _decode(model, ids, PROMPT_LENS, 24, num_draft=3, tree=8, tree_width=2)
    _assert_same(out, plain)
    assert out.stats.accepted_at[1] > 0


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "rounds"))
def _state_after_rounds(graphdef, params, ids, lens, cfg, rounds: int):
    """The loop state after the prefill and `rounds` rounds, as `generate` runs them (greedy)."""
    model = nnx.merge(graphdef, params)
    with speculative.tracing(model, cfg):
        sampling = mtp_jax.SamplingParams.from_config(cfg, ids.shape[0])
        state = speculative.start_state(model, ids, lens, jax.random.key(0), sampling, cfg, greedy=True)
        body = speculative.round_step(model, cfg, None, True, lambda s: ~jnp.all(s.done))
        for _ in range(rounds):
            state = body(state)
        return state


def test_committed_caches_hold_a_plain_prefill_of_the_same_tokens(predictable):
    """After rounds whose accepted paths ran through the middle of their trees, every trunk cache slot below a row's
    position (and every MTP cache slot below its block) holds what a prefill of that row's prompt and tokens
    writes: the accepted entries moved to consecutive slots, values and not only tokens."""
    model, _ = predictable
    cfg = mtp_jax.DecodeConfig(num_draft=3, tree=8, tree_width=3, max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    graphdef, params = nnx.split(model)
    state = _state_after_rounds(graphdef, params, jnp.asarray(PROMPTS), jnp.asarray(PROMPT_LENS), cfg, 4)
    assert int(state.stats.accepted) > 4  # paths past depth 1 were committed
    position, generated = np.asarray(state.position), np.asarray(state.num_generated)
    width = int(position.max())
    rows = np.zeros((len(PROMPTS), width + 1), np.int32)
    for b, length in enumerate(PROMPT_LENS):
        sequence = np.concatenate([PROMPTS[b, :length], np.asarray(state.tokens)[b, : generated[b]]])
        assert len(sequence) == position[b] + 1  # the last, pending, is not in the cache yet
        rows[b, : len(sequence)] = sequence
    positions = jnp.broadcast_to(jnp.arange(width + 1), rows.shape)
    hidden, plain = model.trunk(jnp.asarray(rows), positions, model.new_cache(len(rows), state.cache[0].slots),
                                lengths=jnp.asarray(position + 1))  # fmt: skip
    next_tokens = jnp.asarray(np.concatenate([rows[:, 1:], rows[:, :1] * 0], axis=1))
    mtp_cache = model.new_mtp_cache(len(rows), state.cache[0].slots)
    _, _, plain_mtp = model.mtp_step(hidden, next_tokens, positions, mtp_cache)
    start = np.asarray(state.block.start)
    for b in range(len(rows)):
        for got, want in ((state.cache[0].k, plain[0].k), (state.cache[0].v, plain[0].v)):
            np.testing.assert_allclose(np.asarray(got)[:, b, : position[b]], np.asarray(want)[:, b, : position[b]],
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
        for got, want in ((state.mtp_cache.k, plain_mtp.k), (state.mtp_cache.v, plain_mtp.v)):
            np.testing.assert_allclose(np.asarray(got)[:, b, : start[b]], np.asarray(want)[:, b, : start[b]],
                                       rtol=1e-5, atol=1e-5)  # fmt: skip


def _bfloat16(model):
    graphdef, state = nnx.split(model)
    cast = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return nnx.merge(graphdef, jax.tree.map(cast, state))


needs_invariant_trees = pytest.mark.skipif(
    not execution_plan.invariant_trees(traced_plan.resolve(invariant=True)),
    reason="batch-invariant trees need the CPU row kernel's attention",
)


@needs_invariant_trees
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trees_under_batch_invariant_decoding_give_plain_tokens_at_any_batch(predictable, dtype):
    """Under batch-invariant decoding a node's verify row attends, through the CPU kernel's tree mask, over the cache
    and its ancestors in order: the bits a plain step gets with its path in the cache. So the tree's tokens are plain
    decoding's in bfloat16 too, for the batch and for a row decoded alone."""
    model = predictable[0] if dtype == "float32" else _bfloat16(predictable[0])
    plain = _decode(model, PROMPTS, PROMPT_LENS, num_draft=0, invariant=True)
    tree = _decode(model, PROMPTS, PROMPT_LENS, num_draft=3, tree=8, tree_width=3, invariant=True)
    _assert_same(tree, plain)
    assert tree.stats.accepted_at[1] > 0
    for row in (1, 3):
        alone = _decode(model, PROMPTS[row : row + 1], PROMPT_LENS[row : row + 1], num_draft=3, tree=8, tree_width=3,
                        invariant=True)  # fmt: skip
        np.testing.assert_array_equal(alone.tokens[0], plain.tokens[row])


@needs_invariant_trees
def test_invariant_trees_commit_the_cache_bits_of_plain_decoding(predictable):
    """bfloat16, batch-invariant: after three tree rounds every trunk cache slot below a row's position holds the
    bits plain decoding wrote there (the accepted nodes' entries, computed beside their siblings, then moved)."""
    model = _bfloat16(predictable[0])
    graphdef, params = nnx.split(model)
    ids, lens = jnp.asarray(PROMPTS), jnp.asarray(PROMPT_LENS)
    settings = dict(max_new_tokens=NEW_TOKENS, stop_on_eos=False, invariant=True)
    tree_cfg = mtp_jax.DecodeConfig(num_draft=3, tree=8, tree_width=3, **settings)
    tree = _state_after_rounds(graphdef, params, ids, lens, tree_cfg, 3)
    generated = np.asarray(tree.num_generated)
    assert generated.max() > 3 + 1  # paths past depth 1 were committed
    plain_cfg = mtp_jax.DecodeConfig(num_draft=0, **settings)
    plain = _state_after_rounds(graphdef, params, ids, lens, plain_cfg, int(generated.max()))
    position = np.asarray(tree.position)
    assert (np.asarray(plain.position) >= position).all()
    for b in range(len(PROMPTS)):
        for got, want in ((tree.cache[0].k, plain.cache[0].k), (tree.cache[0].v, plain.cache[0].v)):
            np.testing.assert_array_equal(np.asarray(got)[:, b, : position[b]], np.asarray(want)[:, b, : position[b]])


def test_latent_attention_refuses_a_tree_under_batch_invariant_decoding():
    """Latent attention's batch-invariant form takes no tree mask: refused before anything is traced."""
    model = predictable_moe_model("deepseek_v3", seed=2)
    cfg = mtp_jax.DecodeConfig(num_draft=3, tree=8, tree_width=2, max_new_tokens=4, invariant=True)
    with pytest.raises(ValueError, match="latent attention"):
        mtp_jax.generate(model, PROMPTS[:1] % 64, PROMPT_LENS[:1], jax.random.key(0), cfg)


def _walk(tokens, parents, picks) -> tuple[int, int, list[int]]:
    """The reference: from the root, step into the child whose token is the current entry's pick, while one is."""
    entry, path = 0, [0]
    while True:
        children = [i + 1 for i in range(len(tokens)) if parents[i + 1] == entry and tokens[i] == picks[entry]]
        if not children:
            return len(path) - 1, int(picks[entry]), path
        entry = children[0]
        path.append(entry)


def test_accepted_path_is_the_reference_walk():
    """Random trees (parents before children, distinct tokens among siblings, as drafting makes them) and random
    picks over a 4-token vocabulary, so paths end at every depth and run through any child."""
    rng = np.random.default_rng(0)
    batch, nodes, depth = 400, 9, 4
    tokens = np.zeros((batch, nodes), np.int32)
    parents = np.zeros((batch, nodes + 1), np.int32)
    for b in range(batch):
        depths, children = [0], [[]]
        for i in range(1, nodes + 1):
            parent = rng.choice([j for j in range(i) if depths[j] < depth and len(children[j]) < 4])
            token = rng.choice([t for t in range(4) if t not in children[parent]])
            parents[b, i], tokens[b, i - 1] = parent, token
            children[parent].append(token)
            depths.append(depths[parent] + 1)
            children.append([])
    picks = rng.integers(0, 4, (batch, nodes + 1)).astype(np.int32)
    accepted, token, path = jax.tree.map(
        np.asarray, accepted_path(tokens, BlockTree.of(jnp.asarray(parents), depth), picks)
    )
    for b in range(batch):
        want_depth, want_token, want_path = _walk(tokens[b], parents[b], picks[b])
        assert (accepted[b], token[b]) == (want_depth, want_token), b
        assert path[b, : want_depth + 1].tolist() == want_path, b
    assert len(set(accepted.tolist())) >= 3  # paths of several depths were checked
    hidden = jax.nn.one_hot(picks, 4)  # [B, N+1, 4]: logits whose argmax is each entry's pick
    walked_depth, walked_token, end = greedy_walk(jnp.asarray(tokens), jnp.asarray(parents[:, 1:]), hidden, lambda h: h)
    block = BlockTree.of(jnp.asarray(parents), depth)
    walked_path = jnp.take_along_axis(block.paths, end[:, None, None], axis=1)[:, 0]
    for got, want in zip((walked_depth, walked_token, walked_path), (accepted, token, path), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # the walk that makes logits on the path only
