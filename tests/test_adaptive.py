"""Adaptive draft length: the policy's arithmetic against enumeration, its choices at the extremes of cost and
acceptance, and greedy output identical to plain decoding while the loop moves between j = 0..k drafts."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from checkpoints_convert.export import save_hf_folder
from mtp_jax.adaptive import AcceptanceTracker, choose_num_draft, estimated_round_costs, expected_tokens
from mtp_jax.decode import main as decode_main
from tests.test_lossless_mtp import PROMPT_LENS, PROMPTS
from tests.tiny_models import predictable_model


def test_expected_tokens_matches_enumeration_of_outcomes():
    rates = [0.8, 0.55, 0.3]
    for j in range(len(rates) + 1):
        mean = 0.0
        for outcome in itertools.product([True, False], repeat=j):  # each draft's verdict, were it judged
            accepted = next((i for i, ok in enumerate(outcome) if not ok), j)  # drafts before the first rejection
            probability = np.prod([rates[i] if ok else 1 - rates[i] for i, ok in enumerate(outcome)])
            mean += probability * (accepted + 1)  # the accepted drafts and the target's token
        assert float(expected_tokens(jnp.asarray(rates))[j]) == pytest.approx(mean, rel=1e-6)


def test_rates_fall_back_to_the_depth_before():
    tracker = AcceptanceTracker(hits=jnp.array([90.0, 0.0, 0.0]), trials=jnp.array([100.0, 0.0, 0.0]))
    rates = np.asarray(tracker.rates())
    assert rates[0] == pytest.approx(91 / 102)  # 90 hits of 100 with the prior's 1 of 2
    np.testing.assert_allclose(rates[1:], rates[0])  # never drafted: as good as the last depth measured


def test_policy_drafts_what_pays():
    good = AcceptanceTracker(hits=jnp.array([90.0, 80.0, 70.0]), trials=jnp.array([100.0, 90.0, 80.0]))
    poor = AcceptanceTracker(hits=jnp.array([5.0, 0.0, 0.0]), trials=jnp.array([100.0, 5.0, 0.0]))
    cheap, steep = jnp.array([1.0, 1.2, 1.4, 1.6]), jnp.array([1.0, 2.0, 3.0, 4.0])
    assert int(choose_num_draft(good, cheap)) == 3
    assert int(choose_num_draft(good, steep)) == 0  # a verify row as dear as a whole step: drafting never pays
    assert int(choose_num_draft(poor, cheap)) == 0  # the head rarely agrees: plain rounds


def test_estimated_costs_from_bytes():
    assert estimated_round_costs(1000, 50, 3) == pytest.approx((1.05, 1.05, 1.10, 1.15))
    with pytest.raises(ValueError, match="round_costs needs 4 positive numbers"):
        mtp_jax.DecodeConfig(num_draft=3, adaptive=True, round_costs=(1.0, 1.1))


def test_adaptive_greedy_equals_plain_through_every_draft_length():
    model = predictable_model("deepseek", 11)
    key = jax.random.key(0)
    plain = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=60))
    # Costs near break-even for this head's acceptance (~0.8 at depth 0), so the policy moves between all of j = 0..3.
    costs = (1.0, 1.75, 2.4, 3.0)
    cfg = mtp_jax.DecodeConfig(num_draft=3, max_new_tokens=60, adaptive=True, round_costs=costs)
    out = mtp_jax.generate(model, PROMPTS, PROMPT_LENS, key, cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    np.testing.assert_array_equal(np.asarray(out.finished_by_eos), np.asarray(plain.finished_by_eos))
    assert np.asarray(plain.finished_by_eos).any() and not np.asarray(plain.finished_by_eos).all()  # EOS mid-batch
    rounds_with = np.asarray(out.stats.rounds_with)
    assert (rounds_with > 0).all(), rounds_with
    assert rounds_with.sum() == int(out.stats.rounds)


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "hf"
    save_hf_folder(predictable_model("deepseek", 3), folder)
    return folder


def test_cli_adaptive_decodes_like_plain(checkpoint_folder, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": ids}) + "\n" for ids in ([5, 6, 7], [9, 3], [4] * 7)))
    outputs = {}
    for name, extra in [("plain", ["--no-mtp"]), ("adaptive", ["--adaptive", "--round-costs", "1,1.4,1.8"])]:
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        argv = ["--model", checkpoint_folder, "--prompts-file", prompts, "--out", out, "--stats-json", stats,
                "--max-new-tokens", 24, "--batch-size", 3, "--dtype", "float32", "--num-draft", 2, *extra]  # fmt: skip
        assert decode_main([str(a) for a in argv]) == 0, capsys.readouterr().err
        outputs[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert outputs["adaptive"] == outputs["plain"]
    summary = json.loads(stats.read_text())
    assert sum(summary["rounds_by_num_draft"]) == summary["rounds"]


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
