"""Adaptive draft length: the policy's arithmetic against enumeration, its choices at the extremes of cost and
acceptance, and greedy output identical to plain decoding while the loop moves between j = 0..k drafts."""

from __future__ import annotations

import functools
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.decode.adaptive import (
    LONGEST_REST,
    REST_ROUNDS,
    TREE_GUESSES,
    AcceptanceTracker,
    RestSchedule,
    choose_round,
    drafting_can_pay,
    estimated_round_costs,
    expected_tokens,
    probe_cycle,
)
from mtp_jax.decode.prefill import prefill
from mtp_jax.decode.rounds import Round, RoundKind, catch_up, round_context, run_round
from mtp_jax.decode.speculative import compile_generate
from mtp_jax.models.kv_cache import cache_slots
from mtp_jax.plan.shapes import SHAPES
from tests.support.prompts import MIXED_LENS as PROMPT_LENS
from tests.support.prompts import MIXED_PROMPTS as PROMPTS
from tests.support.tiny_models import predictable_model, tiny_config


def test_expected_tokens_matches_enumeration_of_outcomes():
    rates = [0.8, 0.55, 0.3]
    for j in range(len(rates) + 1):
        mean = 0.0
        for outcome in itertools.product([True, False], repeat=j):  # each draft's verdict, were it judged
            accepted = next((i for i, ok in enumerate(outcome) if not ok), j)  # drafts before the first rejection
            probability = np.prod([rates[i] if ok else 1 - rates[i] for i, ok in enumerate(outcome)])
            mean += probability * (accepted + 1)  # the accepted drafts and the target's token
        assert float(expected_tokens(jnp.asarray(rates))[j]) == pytest.approx(mean, rel=1e-6)


def counts(hits, trials, tree_hits=None, tree_trials=None) -> AcceptanceTracker:
    """A tracker holding these decayed counts (a tree's none where not given)."""
    hits, trials = jnp.asarray(hits, jnp.float32), jnp.asarray(trials, jnp.float32)
    tree_hits = jnp.zeros_like(hits) if tree_hits is None else jnp.asarray(tree_hits, jnp.float32)
    tree_trials = jnp.zeros_like(hits) if tree_trials is None else jnp.asarray(tree_trials, jnp.float32)
    return AcceptanceTracker(hits=hits, trials=trials, tree_hits=tree_hits, tree_trials=tree_trials)


def test_rates_fall_back_to_the_depth_before():
    tracker = counts([90.0, 0.0, 0.0], [100.0, 0.0, 0.0])
    rates = np.asarray(tracker.rates())
    assert rates[0] == pytest.approx(91 / 102)  # 90 hits of 100 with the prior's 1 of 2
    np.testing.assert_allclose(rates[1:], rates[0])  # never drafted: as good as the last depth measured


def test_policy_drafts_what_pays_and_rests_otherwise():
    good = counts([90.0, 80.0, 70.0], [100.0, 90.0, 80.0])
    poor = counts([5.0, 0.0, 0.0], [100.0, 5.0, 0.0])
    cheap, steep = jnp.array([1.0, 1.2, 1.4, 1.6]), jnp.array([1.0, 2.0, 3.0, 4.0])
    room, full = jnp.bool_(True), jnp.bool_(False)
    assert int(choose_round(good, cheap, room)) == 3
    assert int(choose_round(good, steep, room)) == 4  # a verify row as dear as a whole step: rest (index k + 1)
    assert int(choose_round(poor, cheap, room)) == 4  # the head rarely agrees: rest
    assert int(choose_round(poor, cheap, full)) == 0  # ... until the block is full: probe
    # One draft at acceptance 0.99 and cost 1.92 gives 1.0365 tokens per plain step: more than resting with a free
    # probe (1.0), but not by MARGIN (5%); more than resting with a dear one (1 / (1 + (c0 - 1) / C) = 1 / 1.05 =
    # 0.952, C = probe_cycle(1) rounds from probe to probe) by more than MARGIN.
    even = counts([98.0], [98.0])  # rate 99/100
    assert int(choose_round(even, jnp.array([1.0, 1.92]), room)) == 2
    assert probe_cycle(1) == REST_ROUNDS + 2  # one draft: a block of 2 slots and the rests' REST_ROUNDS
    assert int(choose_round(even, jnp.array([1.0 + 0.05 * probe_cycle(1), 1.92]), room)) == 1
    # A probe of 1.17 spread over the cycle's 14 rounds leaves resting 0.988, and 1.05 * 0.988 > 1.0365: rest. Spread
    # over REST_ROUNDS (12) rounds only, it would leave 0.986 and drafting would win.
    assert int(choose_round(even, jnp.array([1.17, 1.92]), room)) == 2


def test_estimated_costs_from_bytes():
    assert estimated_round_costs(1000, 50, 3) == pytest.approx((1.05, 1.05, 1.10, 1.15))
    assert estimated_round_costs(1000, 50, 3, tree=True) == pytest.approx((1.05, 1.05, 1.10, 1.15, 1.15))
    with pytest.raises(ValueError, match="round_costs needs 4 positive numbers"):
        mtp_jax.DecodeConfig(num_draft=3, adaptive=True, round_costs=(1.0, 1.1))
    with pytest.raises(ValueError, match=r"needs 5 positive numbers \(j = 0..3, then the tree's round\)"):
        mtp_jax.DecodeConfig(num_draft=3, adaptive=True, tree=8, round_costs=(1.0, 1.1, 1.2, 1.3))


def test_tree_rates_start_from_the_chains_and_follow_their_own_counts():
    chain_only = counts([60.0, 50.0, 40.0], [100.0, 60.0, 50.0])
    chain = np.asarray(chain_only.rates())
    np.testing.assert_allclose(np.asarray(chain_only.tree_rates()), 1 - (1 - chain) ** TREE_GUESSES, rtol=1e-6)
    measured = counts([60.0, 50.0, 40.0], [100.0, 60.0, 50.0], tree_hits=[30.0, 20.0, 10.0],
                      tree_trials=[100.0, 30.0, 20.0])  # fmt: skip
    prior = 1 - (1 - chain) ** TREE_GUESSES
    expected = (np.array([30.0, 20.0, 10.0]) + 2 * prior) / (np.array([100.0, 30.0, 20.0]) + 2)
    np.testing.assert_allclose(np.asarray(measured.tree_rates()), expected, rtol=1e-6)
    assert (np.asarray(measured.tree_rates()) < chain).all()  # a tree measured worse than the chain stays so
    updated = chain_only.update(jnp.array([5.0, 3.0, 0.0]), jnp.array([8.0, 5.0, 3.0]), tree=True)
    np.testing.assert_allclose(np.asarray(updated.tree_hits), [5.0, 3.0, 0.0])
    np.testing.assert_allclose(np.asarray(updated.hits), np.asarray(chain_only.hits))  # the chain's estimate kept


def test_policy_takes_the_tree_where_it_pays():
    """Index k + 1 is the tree round, k + 2 a rest: the tree where its tokens per unit of time are the best."""
    tree_good = counts([60.0, 50.0, 40.0], [100.0, 60.0, 50.0], [80.0, 60.0, 45.0], [100.0, 80.0, 60.0])
    tree_poor = counts([60.0, 50.0, 40.0], [100.0, 60.0, 50.0], [50.0, 25.0, 10.0], [100.0, 50.0, 25.0])
    room, full = jnp.bool_(True), jnp.bool_(False)
    accelerator = jnp.array([1.0, 1.05, 1.1, 1.15, 1.2])  # a verify of 17 rows about a plain step
    cpu = jnp.array([1.0, 1.56, 2.9, 3.5, 8.6])  # every verify row costs compute (docs/benchmarks.md)
    assert int(choose_round(tree_good, accelerator, room)) == 4
    assert int(choose_round(tree_poor, accelerator, room)) == 3  # measured no better than the chain
    assert int(choose_round(tree_good, cpu, room)) == 5  # nothing beats resting there
    assert int(choose_round(tree_good, cpu, full)) == 0
    assert drafting_can_pay((1.0, 9.0, 9.0, 9.0, 1.2), 3)  # only the tree could pay
    assert not drafting_can_pay((1.0, 9.0, 9.0, 9.0, 4.0), 3)  # a tree's best: 4 tokens a round


@pytest.mark.slow
def test_adaptive_greedy_equals_plain_through_every_draft_length():
    model = predictable_model("deepseek", 11)
    key = jax.random.key(0)
    plain = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=60))
    # Costs near break-even for this head's acceptance (~0.8 at depth 0), so the policy moves between all of j = 0..3.
    costs = (1.0, 1.55, 2.1, 2.7)
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=60, adaptive=True, round_costs=costs)
    out = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    np.testing.assert_array_equal(np.asarray(out.finished_by_eos), np.asarray(plain.finished_by_eos))
    assert np.asarray(plain.finished_by_eos).any() and not np.asarray(plain.finished_by_eos).all()  # EOS mid-batch
    rounds_with, rests = np.asarray(out.stats.rounds_with), int(out.stats.rests)
    assert (rounds_with > 0).all(), rounds_with
    assert rounds_with.sum() == int(out.stats.rounds)
    assert 0 < rests < rounds_with[0], (rests, rounds_with)  # rests, and probes (rounds of j = 0 that were not rests)


@pytest.mark.slow
def test_rest_schedule_probes_ever_more_rarely_until_a_draft():
    schedule, width = RestSchedule.start(), 15
    assert not bool(schedule.may_rest(jnp.bool_(False)))  # full block, no allowance yet: probe
    assert bool(schedule.may_rest(jnp.bool_(True)))  # a block with room always takes a rest
    allowances = []
    for _ in range(7):
        schedule = schedule.after_probe(width)
        allowances.append(int(schedule.allowance))
        for _ in range(int(schedule.allowance)):
            assert bool(schedule.may_rest(jnp.bool_(False)))
            schedule = schedule.after_rest(jnp.bool_(True))
        assert not bool(schedule.may_rest(jnp.bool_(False)))
    assert allowances == [15, 30, 60, 120, 240, LONGEST_REST, LONGEST_REST]
    assert int(schedule.after_rest(jnp.bool_(False)).slides) == int(schedule.slides)  # rests with room do not count
    assert not bool(schedule.after_draft().may_rest(jnp.bool_(False)))


@pytest.mark.slow
def test_long_rests_slide_the_block_and_stay_exact():
    """A head that never pays (random): after the first probes the loop rests through the run, sliding its MTP block
    and probing ever more rarely (fewer probes than one per block's worth of rests); greedy output is plain's."""
    model = mtp_jax.CausalLM(tiny_config("deepseek", eos=()), rngs=nnx.Rngs(2))
    key, settings = jax.random.key(0), dict(max_new_tokens=120, stop_on_eos=False)
    plain = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, mtp_jax.DecodeConfig(num_draft=0, **settings))
    cfg = mtp_jax.DecodeConfig(num_draft=2, adaptive=True, round_costs=(1.0, 1.3, 1.6), **settings)
    out = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    rests, probes = int(out.stats.rests), int(out.stats.rounds_with[0]) - int(out.stats.rests)
    assert rests > 90 and 0 < probes < rests // (probe_cycle(2) - 1), (rests, probes)


@pytest.mark.slow
def test_costs_where_no_draft_can_pay_give_plain_decoding_without_probes():
    assert drafting_can_pay((1.0, 1.75, 2.4, 3.0), 3)
    assert not drafting_can_pay((1.0, 2.0, 3.0, 4.0), 3)  # all drafts accepted: one token per plain step, as resting
    # All accepted, 0.968 tokens per plain step: above resting with dear probes (1 / (1 + 0.6 / 16) = 0.964, a probe
    # every probe_cycle(3) = 16 rounds) but not by MARGIN (1.012); 3 / 2.9 = 1.034 is.
    assert not drafting_can_pay((1.6, 2.2, 3.1, 4.4), 3)
    assert drafting_can_pay((1.6, 2.2, 2.9, 4.4), 3)
    model = predictable_model("deepseek", 11)
    key = jax.random.key(0)
    plain = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=30))
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=30, adaptive=True, round_costs=(1.0, 2.0, 3.0, 4.0))
    out = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    rounds = int(out.stats.rounds)
    assert rounds == int(plain.stats.rounds) and int(out.stats.rests) == rounds  # no probe, no draft
    assert np.asarray(out.stats.rounds_with).tolist() == [rounds, 0, 0, 0]


@pytest.mark.slow
def test_adaptive_rounds_update_the_trunk_cache_in_place():
    """The adaptive loop moves between kinds of round without copying the trunk cache: no more copies of a cache
    buffer in its compiled program than in plain decoding's (a round under `lax.switch`, a conditional whose branches
    may not update their operands in place, copied the cache every round)."""
    model = predictable_model("deepseek", 11)
    key = jax.random.key(0)
    settings = dict(max_new_tokens=20, stop_on_eos=False)
    slots = cache_slots(PROMPTS.shape[1], mtp_jax.DecodeConfig(num_draft=3, **settings))
    shapes = {f"{x.dtype}[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(
        jax.eval_shape(lambda: model.new_cache(PROMPTS.shape[0], slots)))}  # fmt: skip
    shapes = {s.replace("float32", "f32") for s in shapes}

    def cache_copies(cfg) -> int:
        text = compile_generate(model, PROMPTS, PROMPT_LENS, key, cfg).as_text()
        return sum(len(re.findall(rf"= {re.escape(shape)}{{[0-9,]*}} copy\(", text)) for shape in shapes)

    plain = cache_copies(mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=23, stop_on_eos=False))  # same slots
    adaptive = cache_copies(
        mtp_jax.DecodeConfig(num_draft=3, adaptive=True, round_costs=(1.0, 1.2, 1.4, 1.6), **settings)
    )
    assert 0 < plain and adaptive <= plain, (adaptive, plain)  # plain's: the cache's first fill, outside the loop


@pytest.mark.slow
def test_rests_then_catch_up_gives_the_mtp_cache_of_a_prefill():
    """Plain rounds that skip the MTP layer, then a round's catch-up over the queued block, leave the MTP cache as a
    prefill of the prompt plus the generated tokens would (rows of different lengths). A wrong slot, token or
    position in the queue would give different keys and values (and, on a real head, lower acceptance, while the
    output stays exact: so this is the check that catches it)."""
    model = predictable_model("deepseek", 11)
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=32, adaptive=True, stop_on_eos=False)
    lens = jnp.asarray([3, 6], jnp.int32)
    ids = jnp.asarray(PROMPTS[[2, 1], :6]) * (jnp.arange(6) < lens[:, None])
    slots, eos, keys = 48, jnp.zeros((0,), jnp.int32), jax.random.split(jax.random.key(0), 2)
    state = prefill(model, cfg, None, eos, ids, lens, keys, slots)
    ctx = round_context(model, cfg, None, eos, [])
    rest = functools.partial(run_round, ctx, Round(RoundKind.REST))
    for _ in range(REST_ROUNDS):
        state = rest(state)
    assert np.asarray(state.block.count).tolist() == [REST_ROUNDS + 1] * 2
    _, _, caught_up = catch_up(ctx, state)

    # The same text as prompts: prompt + the tokens generated before the pending one; the pending one comes first.
    tokens = np.asarray(state.tokens)
    longer = [list(np.asarray(ids[r, : lens[r]])) + list(tokens[r, :REST_ROUNDS]) for r in range(2)]
    width = max(map(len, longer))
    ids2 = jnp.asarray([row + [0] * (width - len(row)) for row in longer], jnp.int32)
    lens2 = jnp.asarray([len(row) for row in longer], jnp.int32)
    reference = prefill(model, cfg, None, eos, ids2, lens2, keys, slots)
    np.testing.assert_array_equal(np.asarray(reference.pending), tokens[:, REST_ROUNDS])  # same text, same token
    for r in range(2):
        valid = int(lens2[r])  # MTP cache slots 0 .. n-1, n the pending token's position
        for ours, theirs in zip(jax.tree.leaves(caught_up), jax.tree.leaves(reference.mtp_cache), strict=True):
            np.testing.assert_allclose(np.asarray(ours)[:, r, :valid], np.asarray(theirs)[:, r, :valid], atol=2e-5)


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "hf"
    save_hf_folder(predictable_model("deepseek", 3), folder)
    return folder


@pytest.mark.slow
def test_cli_adaptive_decodes_like_plain(checkpoint_folder, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": ids}) + "\n" for ids in ([5, 6, 7], [9, 3], [4] * 7)))
    outputs = {}
    adaptive_tree = ["--adaptive", "--tree", "6", "--tree-width", "2", "--round-costs", "1,1.4,1.8,1.9"]
    for name, extra in [("plain", ["--no-mtp"]), ("adaptive", ["--adaptive", "--round-costs", "1,1.4,1.8"]),
                        ("adaptive_tree", adaptive_tree)]:  # fmt: skip
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        argv = ["--model", checkpoint_folder, "--prompts-file", prompts, "--out", out, "--stats-json", stats,
                "--max-new-tokens", 24, "--batch-size", 3, "--dtype", "float32", "--num-draft", 2, *extra]  # fmt: skip
        assert decode_main([str(a) for a in argv]) == 0, capsys.readouterr().err
        outputs[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
        summary = json.loads(stats.read_text())
        assert sum(summary["rounds_by_num_draft"]) == summary["rounds"]
    assert outputs["adaptive"] == outputs["plain"] and outputs["adaptive_tree"] == outputs["plain"]
    assert summary["tree"] == 6 and summary["tree_rounds"] > 0, summary  # the last decode's: its trees ran


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--round-costs", "1,1.1,1.2"], "--round-costs goes with --adaptive"),
        (["--adaptive", "--round-costs", "1,1.1"], "round_costs needs 3 positive numbers"),
        (["--adaptive", "--round-costs", "1,x,2"], "expected comma-separated numbers"),
        (["--adaptive", "--no-mtp"], "--adaptive needs drafts"),
    ],
)
def test_cli_bad_adaptive_settings_are_refused(checkpoint_folder, capsys, tmp_path, extra, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6]}) + "\n")
    argv = ["--model", str(checkpoint_folder), "--prompts-file", str(prompts), "--num-draft", "2", *extra]
    try:
        code = decode_main(argv)
    except SystemExit as e:  # argparse's own refusal of a malformed value
        code = e.code
    assert code != 0
    err = capsys.readouterr().err.strip()
    assert message in err.splitlines()[-1] and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny", "deepseek-v3-tiny"])  # the two cache forms: GQA (gated attention's too), MLA
def test_sliding_rests_leave_the_mtp_layer_the_blocks_context_only(shape):
    """Rests past a full MTP block slide it: the probe's catch-up then runs the MTP layer over the last W positions
    only, attending to none of its older cache (stale across the skipped positions). So its output must equal the
    MTP layer over those W trunk hiddens and next tokens with no cache at all, at positions shifted to start at 0
    (rotary attention depends on relative positions only). A wrong slide (slot, token, start) or a missing mask
    gives another output; the last lines show that the stale prefix, were it visible, would change it."""
    model = mtp_jax.CausalLM(SHAPES[shape](), rngs=nnx.Rngs(4))
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=40, adaptive=True, stop_on_eos=False)
    width, slides = probe_cycle(2), 5
    lens = jnp.asarray([3, 6], jnp.int32)
    ids = jnp.asarray([[5, 9, 7, 0, 0, 0], [8, 4, 6, 10, 11, 12]], jnp.int32)
    slots, eos, keys = 64, jnp.zeros((0,), jnp.int32), jax.random.split(jax.random.key(0), 2)
    state = prefill(model, cfg, None, eos, ids, lens, keys, slots)
    ctx = round_context(model, cfg, None, eos, [])
    rest = jax.jit(functools.partial(run_round, ctx, Round(RoundKind.REST)))
    for _ in range(width - 1 + slides):
        state = rest(state)
    start = np.asarray(lens) - 1 + slides  # the block's first position
    np.testing.assert_array_equal(np.asarray(state.block.start), start)
    np.testing.assert_array_equal(np.asarray(state.block.visible_from), start)
    assert np.asarray(state.block.count).tolist() == [width, width]
    _, normed, _ = catch_up(ctx, state)

    tokens = np.asarray(state.tokens)
    for r in range(2):
        text = list(np.asarray(ids[r, : lens[r]])) + list(tokens[r, : width + slides])  # through the pending token
        n = len(text) - 1  # the pending token's position
        assert n == start[r] + width
        trunk_ids = jnp.asarray([text[:n]], jnp.int32)
        hidden, _ = model.trunk(trunk_ids, jnp.arange(n)[None], model.new_cache(1, slots))  # [1, n, D]
        block_hidden = hidden[:, start[r] : n]  # h[start .. n-1]
        block_tokens = jnp.asarray([text[start[r] + 1 : n + 1]], jnp.int32)  # x[start+1 .. n]
        _, expected, _ = model.mtp_step(block_hidden, block_tokens, jnp.arange(width)[None], model.new_mtp_cache(1, 8))
        np.testing.assert_allclose(np.asarray(normed[r]), np.asarray(expected[0, -1]), atol=1e-4, rtol=1e-4)

    # With the stale prefix visible (no mask) the output moves: the check above can fail.
    unmasked_block = state.block.replace(visible_from=jnp.zeros_like(lens))
    _, unmasked, _ = catch_up(ctx, state.replace(block=unmasked_block))
    assert not np.allclose(np.asarray(unmasked), np.asarray(normed), atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "eos", "costs"),
    [("deepseek", 3, (1.0, 1.55, 2.1, 2.7, 2.9)), ("mimo", 5, (1.0, 1.45, 1.9, 2.35, 2.6))],
)  # two MTP layouts, EOS mid-batch in each
def test_adaptive_with_a_tree_equals_plain_through_every_kind_of_round(layout, eos, costs):
    """With a draft tree the policy moves between probes, rests, chains of 1..3 and the tree (costs near
    break-even for this head), and greedy output stays plain's: mixed prompt lengths, EOS mid-batch."""
    model = predictable_model(layout, 11, cfg=tiny_config(layout, eos=(eos,)))
    key = jax.random.key(0)
    plain = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=60))
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=60, adaptive=True, round_costs=costs, tree=8, tree_width=2)
    out = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    np.testing.assert_array_equal(np.asarray(out.finished_by_eos), np.asarray(plain.finished_by_eos))
    assert np.asarray(plain.finished_by_eos).any() and not np.asarray(plain.finished_by_eos).all()
    rounds_with, rests, trees = np.asarray(out.stats.rounds_with), int(out.stats.rests), int(out.stats.tree_rounds)
    assert rounds_with.sum() == int(out.stats.rounds)
    assert 0 < rests < rounds_with[0], (rests, rounds_with)  # rests and probes
    assert 0 < trees < rounds_with[1:].sum(), (rounds_with, trees)  # trees and chains
