"""The benchmark harness end to end on tiny models (smoke tests: no timing is asserted)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli.bench import main as bench_main
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.decode.round_timing import RoundTimer
from mtp_jax.kernels import traced_plan
from mtp_jax.plan.shapes import SHAPES
from tests.support.hybrid_models import predictable_hybrid_model

POSITIVE_FIELDS = ("tokens_per_second", "prefill_ms", "mean_accepted_length", "wall_seconds", "speedup_vs_plain")


def check_rows(rows: list[dict], max_new_tokens: int) -> None:
    for row in rows:
        for field in POSITIVE_FIELDS:
            assert math.isfinite(row[field]) and row[field] > 0, (field, row)
        assert row["ms_per_round"] is None or row["ms_per_round"] > 0  # None: lost in a tiny model's timing noise
        assert row["generated_tokens"] == row["batch"] * max_new_tokens  # EOS stops nothing: equal work
        assert len(row["acceptance_per_position"]) == row["k"]
        assert all(0 <= p <= 1 for p in row["acceptance_per_position"])


@pytest.mark.slow
def test_bench_random_shape(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = bench_main([
        "--random-shape", "tiny", "--batch-sizes", "2", "--num-draft", "0,2", "--max-new-tokens", "8",
        "--repeats", "1", "--no-peer", "--tree", "4", "--tree-width", "2", "--json", str(out),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["meta"]["model"] == "random weights, shape tiny" and result["meta"]["command"].endswith(str(out))
    assert result["meta"]["execution_plan"] == traced_plan.resolve().as_dict()
    rows = result["rows"]
    assert [(r["impl"], r["batch"], r["k"]) for r in rows] == [
        ("mtp_jax", 2, 0), ("mtp_jax", 2, 2), ("mtp_jax adaptive", 2, 2), ("mtp_jax tree N=4 W=2", 2, 2),
        ("mtp_jax adaptive, tree N=4 W=2", 2, 2),
    ]  # fmt: skip
    check_rows(rows, 8)
    assert all(r["compile_seconds"] > 0 and r["ours_over_peer"] is None and r["memory_mb"] > 0 for r in rows)
    assert all(r["same_tokens"] for r in rows if r["k"])  # greedy MTP, adaptive included, is lossless
    fixed = [r for r in rows if r["impl"] == "mtp_jax"]
    assert all(r["round_ms"] > 0 and r["verify_ms"] > 0 and (r["draft_ms"] > 0) == (r["k"] > 0) for r in fixed)
    assert all(r["verify_over_plain"] > 0 for r in fixed)
    for r in fixed:  # a loop's time per round is None where the prefill's timing noise swallows it (tiny models)
        measured = r["ms_per_round"] is not None and rows[0]["ms_per_round"] is not None
        expected = pytest.approx(r["ms_per_round"] / rows[0]["ms_per_round"]) if measured else None
        assert r["round_over_plain"] == expected
    plain = [r for r in fixed if r["k"] == 0]
    assert all(r["bytes_per_step"] > 0 and 0 < r["roofline_fraction"] for r in plain)
    assert result["meta"]["copy_bandwidth_gb_s"] > 0
    for r in rows:
        if "round_costs" in r:
            costs = r["round_costs"]
            # the probe (j = 0, over a block filled by rests) may cost more than a narrow drafting round; a tree's
            # round (its cost last) drafts and verifies more than the chain of its depth
            assert len(costs) == 3 + bool(r["tree"]) and min(costs) >= 1 and costs[1:3] == sorted(costs[1:3])
            assert sum(r["rounds_by_num_draft"]) == r["rounds"] and r["tree_rounds"] <= r["rounds_by_num_draft"][2]
    assert "| mtp_jax | 2 | 2 |" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_tree_rows(tmp_path, capsys):
    """--tree N,...: a row per node budget, as deep as the largest k, with plain decoding's tokens; a budget the
    depth and width cannot hold is one line."""
    out = tmp_path / "b.json"
    common = ["--random-shape", "tiny", "--batch-sizes", "2", "--num-draft", "0,2", "--max-new-tokens", "8",
              "--repeats", "1", "--no-peer", "--no-adaptive", "--no-split"]  # fmt: skip
    assert bench_main([*common, "--tree", "4,6", "--tree-width", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["k"], r["tree"]) for r in rows] == [
        ("mtp_jax", 0, 0), ("mtp_jax", 2, 0), ("mtp_jax tree N=4 W=2", 2, 4), ("mtp_jax tree N=6 W=2", 2, 6)
    ]  # fmt: skip
    check_rows(rows, 8)
    assert all(r["same_tokens"] for r in rows if r["k"])
    capsys.readouterr()
    assert bench_main([*common, "--tree", "1", "--tree-width", "2"]) == 1
    err = capsys.readouterr().err
    assert "--tree 1: a tree of depth 2 holds at least 2 nodes" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_bench_peer_on_hf_folder(tmp_path, capsys):
    save_hf_folder(mtp_jax.CausalLM(SHAPES["tiny"](), rngs=nnx.Rngs(0)), tmp_path / "hf")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [5, 6, 7]}\n{"token_ids": [8, 9, 10, 11, 12]}\n')
    code = bench_main([
        "--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--batch-sizes", "1,2",
        "--num-draft", "2", "--max-new-tokens", "8", "--repeats", "1", "--json", str(tmp_path / "b.json"),
        "--markdown", str(tmp_path / "b.md"), "--dtype", "float32", "--no-split",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "b.json").read_text())
    rows = result["rows"]
    assert [(r["impl"], r["batch"], r["k"]) for r in rows] == [
        ("mtp_jax", 1, 0), ("mtp_jax", 1, 2), ("transformers", 1, 0),
        ("mtp_jax", 2, 0), ("mtp_jax", 2, 2), ("transformers", 2, 0),
    ]  # fmt: skip
    check_rows(rows, 8)
    assert all(r["same_tokens"] for r in rows if r["impl"] == "transformers" or r["k"])  # same greedy tokens
    markdown = (tmp_path / "b.md").read_text()
    assert "transformers (" in markdown and f"- execution plan: {traced_plan.resolve().summary()}" in markdown


@pytest.mark.parametrize(
    "argv",
    [
        ["--repeats", "0"],
        ["--batch-sizes", "1,x"],
        ["--random-shape", "nope"],
        ["--random-shape", "tiny", "--model", "m.gguf"],
    ],
)
def test_bench_bad_option_is_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "missing.gguf"], "no such model"),
        (["--random-shape", "tiny", "--peer"], "no transformers peer"),
        (["--temperature", "-1"], "--temperature"),
        (["--random-shape", "tiny", "--adaptive", "--no-split"], "--adaptive needs --split"),  # costs come from it
    ],
)
def test_bench_bad_input_is_one_line(argv, message, capsys):
    assert bench_main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_round_parts_time_a_hybrid_trunk():
    """The split timer runs a hybrid trunk's parts (its verify pass keeps per-position recurrent states, then picks
    one per row, as a round does)."""
    ids, lens = np.array([[5, 6, 7, 0], [8, 9, 10, 11]], np.int32), np.array([3, 4], np.int32)
    split = RoundTimer(predictable_hybrid_model(0), ids, lens, 8, iterations=2, repeats=1).split(2)
    assert all(math.isfinite(v) and v > 0 for v in split.values()), split


@pytest.mark.slow
def test_resting_cycle_part_is_the_adaptive_loops_rests_then_a_probe():
    """The probe's cost in an adaptive loop's round costs is read off this part: one cycle must be the block width's
    rests less one, then one probe over the filled block, leaving the block as a probe does (one slot)."""
    from flax import nnx as flax_nnx

    from mtp_jax.config.decode import DecodeConfig
    from mtp_jax.decode.adaptive import probe_cycle
    from mtp_jax.decode.round_timing import prefilled_state, repeat_part

    model = mtp_jax.CausalLM(SHAPES["tiny"](), rngs=nnx.Rngs(0))
    ids, lens = np.array([[5, 6, 7, 0], [8, 9, 10, 11]], np.int32), np.array([3, 4], np.int32)
    cfg = DecodeConfig(num_draft=2, max_new_tokens=40, stop_on_eos=False, adaptive=True)
    graphdef, params = flax_nnx.split(model)
    state = prefilled_state(graphdef, params, ids, lens, cfg, 64)
    after = repeat_part(graphdef, params, state, cfg, "cycle", 0, 1)
    width = probe_cycle(2)
    assert int(after.stats.rounds) == width and int(after.stats.rests) == width - 1
    assert np.asarray(after.block.count).tolist() == [1, 1]
    np.testing.assert_array_equal(np.asarray(after.block.start), np.asarray(lens) + width - 1)  # the probed slot
    costs = RoundTimer(model, ids, lens, 40, iterations=2, repeats=1).adaptive_costs(2)
    assert len(costs) == 3 and all(c >= 1 for c in costs) and costs[2] >= costs[1], costs


def test_sweeps_alternate_their_order():
    from mtp_jax.bench.timing import interleaved_walls

    calls = []
    runs = [lambda name=name: calls.append(name) or float(len(calls)) for name in "abc"]
    walls = interleaved_walls(runs, 3)
    assert "".join(calls) == "abccbaabc"
    assert walls == [[1.0, 6.0, 7.0], [2.0, 5.0, 8.0], [3.0, 4.0, 9.0]]  # per configuration, in sweep order


def part_program(part: str, num_draft: int) -> tuple[str, int]:
    """(HLO text of the timed `part` of a tiny model's round with `num_draft` drafts, batch 2; its vocabulary)."""
    from mtp_jax.config.decode import DecodeConfig
    from mtp_jax.decode.round_timing import prefilled_state, repeat_part

    model = mtp_jax.CausalLM(SHAPES["tiny"](), rngs=nnx.Rngs(0))
    ids, lens = np.array([[5, 6, 7, 0], [8, 9, 10, 11]], np.int32), np.array([3, 4], np.int32)
    cfg = DecodeConfig(num_draft=num_draft, max_new_tokens=8, stop_on_eos=False)
    graphdef, params = nnx.split(model)
    state = prefilled_state(graphdef, params, ids, lens, cfg, 16)
    hlo = repeat_part.lower(graphdef, params, state, cfg, part, num_draft, 1).compile().as_text()
    return hlo, model.config.vocab_size


@pytest.mark.slow
def test_verify_part_computes_the_logits():
    """The timed verify pass of a dense trunk (no recurrent states to keep) still computes its lm_head over the
    block: a program that dropped it as dead code would time the trunk's layers alone."""
    hlo, vocab = part_program("verify", 2)
    assert f"f32[2,3,{vocab}]" in hlo, f"no [B, j+1, V] logits in the verify part's program (V = {vocab})"


@pytest.mark.slow
def test_draft_part_computes_the_drafts():
    """The timed draft part runs the whole MTP layer and the draft head: a program keeping only what the MTP cache
    needs (the layer's keys and values) would time a fraction of a round's drafting."""
    hlo, vocab = part_program("draft", 1)
    assert f"f32[2,{vocab}]" in hlo, f"no [B, V] draft logits in the draft part's program (V = {vocab})"
