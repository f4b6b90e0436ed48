"""The benchmark harness end to end on a tiny checkpoint (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import math

from flax import nnx

import mtp_jax
from checkpoints_convert.export import save_hf_folder
from mtp_jax.bench import main as bench_main
from tests.tiny_models import tiny_config


def test_bench_rows_with_peer(tmp_path, capsys):
    cfg = tiny_config("deepseek", vocab=64, eos=(2,)).replace(max_position_embeddings=256)
    save_hf_folder(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "hf")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [5, 6, 7]}\n{"token_ids": [8, 9, 10, 11, 12]}\n')
    code = bench_main([
        "--model", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--batch-sizes", "1,2",
        "--num-draft", "0,2", "--max-new-tokens", "8", "--repeats", "1", "--json", str(tmp_path / "b.json"),
        "--markdown", str(tmp_path / "b.md"), "--dtype", "float32",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "b.json").read_text())
    assert {(r["impl"], r["batch"], r["k"]) for r in rows} == {
        ("mtp_jax", 1, 0), ("mtp_jax", 1, 2), ("transformers", 1, 0),
        ("mtp_jax", 2, 0), ("mtp_jax", 2, 2), ("transformers", 2, 0),
    }  # fmt: skip
    for row in rows:
        assert math.isfinite(row["tokens_per_second"]) and row["tokens_per_second"] > 0
        assert row["same_tokens_as_plain"], row  # MTP and the peer decode exactly what plain decoding does
    assert "| mtp_jax | 2 | 2 |" in (tmp_path / "b.md").read_text()


def test_bench_bad_option_is_one_line(capsys, tmp_path):
    code = bench_main(["--model", str(tmp_path / "missing"), "--repeats", "0"])
    assert code == 1 and len(capsys.readouterr().err.strip().splitlines()) == 1
