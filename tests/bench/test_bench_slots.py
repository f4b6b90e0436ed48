"""`bench --refill` (slots that refill vs static batches) and `bench --serve` (a load test of the server) end to end on
the default model, small (no timing is asserted), their latency arithmetic, and their bad options."""

from __future__ import annotations

import json

import pytest

from mtp_jax.cli.bench import main as bench_main
from mtp_jax.cli.bench_serve import StreamTiming, summarize


@pytest.mark.slow
@pytest.mark.usefixtures("optimized_compiles")  # conftest.py: the default model's compiles as the CLI makes them
def test_refill_rows_compare_slots_with_static_batches(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = bench_main(["--refill", "--prompts", "3", "--batch-sizes", "2", "--num-draft", "1", "--max-new-tokens",
                       "24", "--no-adaptive", "--no-peer", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["rows"], r["k"]) for r in rows] == [
        ("static batches", 2, 0), ("slots", 2, 0), ("static batches", 2, 1), ("slots", 2, 1)
    ]  # fmt: skip
    assert all(r["same_tokens"] == "3/3" for r in rows if r["mode"] == "slots")
    assert len({r["generated_tokens"] for r in rows}) == 1 and rows[0]["generated_tokens"] > 3
    assert all(r["tokens_per_second"] > 0 for r in rows)
    assert "| slots | 2 | 1 |" in capsys.readouterr().out


@pytest.mark.slow
def test_serve_load_test_drives_the_server(tmp_path, capsys):
    out = tmp_path / "s.json"
    code = bench_main(["--serve", "--prompts", "3", "--clients", "2", "--batch-sizes", "1", "--num-draft", "0",
                       "--max-new-tokens", "12", "--prefill-chunk", "16", "--no-peer", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["slots"], r["k"], r["prefill_chunk"], r["completed"]) for r in rows] == [(1, 0, 16, 3), (1, 0, 0, 3)]
    for row in rows:
        assert 3 <= row["output_tokens"] <= 36 and row["output_throughput"] > 0
        assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"] and 0 <= row["median_itl_ms"] <= row["p99_itl_ms"]
        assert row["offline_output_throughput"] > 0 and 0 <= row["client_cpu_share"] <= 1


def test_serving_metrics_of_known_timings():
    """TTFT from each request's send to its first chunk, ITL the gaps between a stream's chunks (milliseconds)."""
    timings = [
        StreamTiming(sent=0.0, chunks=[0.1, 0.15, 0.25], output_tokens=3),
        StreamTiming(sent=1.0, chunks=[1.3, 1.32], output_tokens=2),
        StreamTiming(sent=2.0, chunks=[2.2], output_tokens=1),
    ]
    metrics = summarize(timings, wall=4.0)
    assert metrics["completed"] == 3 and metrics["output_tokens"] == 6
    assert metrics["request_throughput"] == pytest.approx(0.75) and metrics["output_throughput"] == pytest.approx(1.5)
    assert metrics["median_ttft_ms"] == pytest.approx(200.0)  # of 100, 300, 200
    assert metrics["median_itl_ms"] == pytest.approx(50.0)  # of 50, 100, 20
    assert metrics["p99_itl_ms"] == pytest.approx(99.0)  # between 50 and 100, 98% of the way
    assert metrics["p99_ttft_ms"] == pytest.approx(298.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--refill", "--serve"], "one at a time"),
        (["--serve", "--request-rate", "0"], "--request-rate must be > 0"),
        (["--refill", "--random-shape", "tiny"], "needs a model with a tokenizer"),
        (["--serve", "--random-shape", "tiny"], "needs a model with a tokenizer"),
    ],
)
def test_bad_refill_and_serve_options_are_one_line(argv, message, capsys):
    assert bench_main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
