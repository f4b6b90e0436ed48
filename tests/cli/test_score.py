"""Teacher-forced scoring agrees with what the decode loop actually accepts."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax.cli.score import acceptance_counts, summarize, teacher_forced_predictions
from mtp_jax.cli.score import main as score_main
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.training.head_refresh import draft_agreement, rollout_batch
from tests.support.tiny_models import predictable_model

pytestmark = pytest.mark.slow


def replay_rounds(predictions, trunk, prompt_len, total_len, k):
    """Decode rounds simulated from teacher-forced predictions on the model's own greedy output.

    A round starts at MTP slot p with x[p+1] pending and emits x[p+2]...; rounds run until x[total_len - 1].
    """
    p, rounds, reached, accepted_at = prompt_len - 1, 0, np.zeros(k, int), np.zeros(k, int)
    while p + 2 < total_len:
        rounds += 1
        a = 0
        while a < k and predictions[p, a] == trunk[p + a + 1]:
            a += 1
        reached[: min(a + 1, k)] += 1
        accepted_at[:a] += 1
        p += a + 1
    return rounds, reached, accepted_at


@pytest.mark.parametrize("layout", ["deepseek", "mimo"])
@pytest.mark.parametrize("k", [1, 3])
def test_replayed_rounds_equal_decode_stats(layout, k):
    model = predictable_model(layout, seed=1)
    prompt = np.array([[5, 9, 13, 7]])
    new = 48
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=new, stop_on_eos=False)
    out = mtp_jax.generate(model, prompt, np.array([4]), jax.random.key(0), cfg)
    # The model's own greedy continuation, k + 1 tokens past the budget so the last round's drafts can be judged.
    longer = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=new + k + 1, stop_on_eos=False)
    reference = np.asarray(mtp_jax.generate(model, prompt, np.array([4]), jax.random.key(0), longer).tokens[0])
    np.testing.assert_array_equal(reference[:new], np.asarray(out.tokens[0]))
    predictions, trunk = teacher_forced_predictions(model, np.concatenate([prompt[0], reference])[None], k)
    rounds, reached, accepted_at = replay_rounds(predictions[0], trunk[0], 4, 4 + new, k)
    assert rounds == int(out.stats.row_rounds)
    np.testing.assert_array_equal(reached, np.asarray(out.stats.reached))
    np.testing.assert_array_equal(accepted_at, np.asarray(out.stats.accepted_at))
    assert accepted_at[-1] > 0  # the deepest draft is sometimes accepted: the chain is exercised


def test_acceptance_counts_by_hand():
    trunk = np.array([[10, 11, 12, 13, 14]])  # trunk's prediction of x[p+1]
    predictions = np.array([[[11, 12], [12, 99], [0, 14], [14, 0], [0, 0]]])  # depth 1 predicts x[p+2]
    counts = acceptance_counts(predictions, trunk, np.array([5]))
    assert counts["judged"] == [4, 3] and counts["agreed"] == [3, 2]
    # depth 2 is judged only where depth 1 agreed (p = 0, 1, 3) and x[p+3] exists (p <= 2): p = 0, 1
    assert counts["judged_chained"] == [4, 2] and counts["agreed_chained"] == [3, 1]
    summary = summarize(counts)
    assert summary["conditional_acceptance_per_depth"] == [0.75, 0.5]
    assert summary["expected_accepted_length"] == pytest.approx(1 + 0.75 + 0.75 * 0.5)
    # A response starting at 3: decoding drafts from slot 2 on, so only chains p >= 2 count.
    response_only = acceptance_counts(predictions, trunk, np.array([5]), starts=np.array([3]))
    assert response_only["judged"] == [2, 1] and response_only["agreed"] == [1, 1]
    assert response_only["judged_chained"] == [2, 0] and response_only["agreed_chained"] == [1, 0]


def test_cli_writes_draft_argmax(tmp_path, capsys):
    model = predictable_model("deepseek", seed=4)
    save_hf_folder(model, tmp_path / "hf")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [5, 9, 13, 7, 8, 20]}\n{"token_ids": [4, 6]}\n')
    code = score_main(["--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--num-draft", "2",
                       "--out", str(tmp_path / "s.json"), "--dtype", "float32"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "s.json").read_text())
    assert [len(x) for x in result["draft_argmax"]] == [5, 1]
    assert len(result["conditional_acceptance_per_depth"]) == 2
    predictions, _ = teacher_forced_predictions(model, np.array([[5, 9, 13, 7, 8, 20]]), 1)
    assert result["draft_argmax"][0] == predictions[0, :5, 0].tolist()


def test_cli_scores_a_distilled_record_on_its_response(tmp_path, capsys):
    """A line of `distill` output carries the prompt text and the full token ids: scoring uses the ids, counting
    from its prompt_len on (the response), not the prompt text."""
    model = predictable_model("deepseek", seed=4)
    save_hf_folder(model, tmp_path / "hf")
    ids = [5, 9, 13, 7, 8, 20, 11, 4]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "no tokenizer needed", "token_ids": ids, "prompt_len": 3}) + "\n")
    code = score_main(["--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--num-draft", "2",
                       "--out", str(tmp_path / "s.json"), "--dtype", "float32"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "s.json").read_text())
    predictions, trunk = teacher_forced_predictions(model, np.array([ids]), 2)
    expected = summarize(acceptance_counts(predictions, trunk, np.array([len(ids)]), starts=np.array([3])))
    assert result["positions_judged"] == expected["positions_judged"] == [5, 4]
    assert result["conditional_acceptance_per_depth"] == expected["conditional_acceptance_per_depth"]

    capsys.readouterr()
    prompts.write_text(json.dumps({"token_ids": ids, "prompt_len": 8}) + "\n")
    assert score_main(["--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--num-draft", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "prompt_len" in err and len(err.splitlines()) == 1


def test_cli_sampled_acceptance_is_the_heads_agreement_over_all_positions(tmp_path, capsys):
    """The T = 1 expected acceptance per depth, scored a sequence a batch, is draft_agreement's over both sequences
    in one batch (each batch's mean weighted by its positions), on the responses only."""
    model = predictable_model("deepseek", seed=4)
    save_hf_folder(model, tmp_path / "hf")
    records = [
        {"token_ids": [5, 9, 13, 7, 8, 20, 11, 4, 6], "prompt_len": 3},
        {"token_ids": [4, 6, 2, 9, 23], "prompt_len": 1},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    code = score_main(["--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--num-draft", "2",
                       "--batch-size", "1", "--out", str(tmp_path / "s.json"), "--dtype", "float32"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "s.json").read_text())
    tokens = np.zeros((2, 9), np.int32)
    for row, record in enumerate(records):
        tokens[row, : len(record["token_ids"])] = record["token_ids"]
    batch = rollout_batch(model, tokens, np.array([9, 5]), np.array([3, 1]))
    together = draft_agreement(model, batch, num_steps=2)
    assert together["positions"] == [9, 8]  # x[s+2] in a response: slots 1-6 and 0-2; a depth-2 chain starts at s - 1
    np.testing.assert_allclose(result["expected_acceptance_t1_per_depth"], together["expected"], rtol=1e-5)
    assert 0 < min(together["expected"]) and max(together["expected"]) < 1
