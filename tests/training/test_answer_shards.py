"""Answer shards: a resumable, accumulating data set. A run makes only the shards its folder lacks, a killed run
leaves no half shard, shards hold exactly the answers `distill` gives, and a bad or foreign file is one clear line."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli import distill as distill_cli
from mtp_jax.runtime.errors import UserError
from mtp_jax.training import answer_shards
from mtp_jax.training.prompt_builder import build_prompts
from tests.support.tiny_models import tiny_config
from tests.training.test_distill import CharTokenizer

TRUNK = {"family": "llama", "vocab_size": 64, "hidden_size": 32, "num_layers": 2}


def records(count: int) -> list[dict]:
    rng = np.random.default_rng(count)
    return [
        {"token_ids": rng.integers(0, 64, 5 + i).tolist(), "prompt_len": 2 + i % 3, "category": "code"}
        for i in range(count)
    ]


def test_shards_round_trip_and_name_their_settings(tmp_path):
    run = answer_shards.ShardRun("train", 3, 1.0, 16)
    written = records(4) + records(5)[1:]
    answer_shards.write(str(tmp_path), run, 0, 4, written[:4], TRUNK)
    answer_shards.write(str(tmp_path), run, 4, 8, written[4:], TRUNK)
    assert sorted(p.name for p in tmp_path.iterdir()) == [run.name(0, 4), run.name(4, 8)]
    assert answer_shards.read(str(tmp_path), TRUNK) == written
    assert answer_shards.read(str(tmp_path), TRUNK, split="eval") == []
    assert answer_shards.missing(str(tmp_path), run, answer_shards.ranges(10, 4, 100)) == [(8, 12)]
    assert answer_shards.ranges(10, 4, 100) == [(0, 4), (4, 8), (8, 12)]  # whole shards, so a longer run extends
    assert answer_shards.ranges(10, 4, 9) == [(0, 4), (4, 8), (8, 9)]  # the last cut where the prompts end
    with np.load(tmp_path / run.name(0, 4)) as shard:
        assert shard["tokens"].dtype == np.uint16


def test_a_run_of_other_categories_names_them_and_adds_to_the_folder(tmp_path):
    mixed, explain = (
        answer_shards.ShardRun("train", 0, 0.0, 16),
        answer_shards.ShardRun("train", 0, 0.0, 16, ("explain",)),
    )
    assert mixed.name(0, 4) == "train-seed0-t0-max16-0000000-0000004.npz"
    assert explain.name(0, 4) == "train-explain-seed0-t0-max16-0000000-0000004.npz"
    kept, added = records(4), [{**r, "category": "explain"} for r in records(3)]
    answer_shards.write(str(tmp_path), mixed, 0, 4, kept, TRUNK)
    answer_shards.write(str(tmp_path), explain, 0, 3, added, TRUNK)
    assert answer_shards.missing(str(tmp_path), explain, [(0, 3), (3, 6)]) == [(3, 6)]
    assert answer_shards.read(str(tmp_path), TRUNK) == added + kept  # both mixes, in name order


def test_foreign_and_damaged_shards_are_one_line(tmp_path):
    run = answer_shards.ShardRun("train", 0, 0.0, 16)
    with pytest.raises(UserError, match="no answer shards"):
        answer_shards.read(str(tmp_path / "missing"))
    answer_shards.write(str(tmp_path), run, 0, 2, records(2), TRUNK)
    with pytest.raises(UserError, match="answered by another trunk"):
        answer_shards.read(str(tmp_path), {**TRUNK, "num_layers": 3})
    (tmp_path / run.name(2, 4)).write_bytes(b"not a zip")
    with pytest.raises(UserError, match="not a readable answer shard") as error:
        answer_shards.read(str(tmp_path), TRUNK)
    assert len(str(error.value).splitlines()) == 1


def test_a_failed_write_leaves_no_shard(tmp_path):
    run = answer_shards.ShardRun("train", 0, 0.0, 16)
    bad = records(2)
    bad[1]["category"] = "not a category"
    with pytest.raises(ValueError):
        answer_shards.write(str(tmp_path), run, 0, 2, bad, TRUNK)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_distill_makes_only_missing_shards_and_they_hold_its_answers(tmp_path):
    model = mtp_jax.CausalLM(tiny_config("deepseek", vocab=64, eos=()), rngs=nnx.Rngs(0))
    tokenizer = CharTokenizer(model.config.vocab_size)
    run = answer_shards.ShardRun("train", 2, 1.0, 6)
    folder = str(tmp_path)
    assert distill_cli.distill_shards(model, tokenizer, folder, run, 5, 3, batch_size=2)[0] == 2
    first = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert sorted(first) == [run.name(0, 3), run.name(3, 6)]
    # more prompts: the kept shards stay as they are, only the new one is made
    assert distill_cli.distill_shards(model, tokenizer, folder, run, 8, 3, batch_size=3)[0] == 1
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name in first} == first
    # a shard's answers are those distill gives its prompts, sampled from streams keyed by each prompt's index
    prompts = build_prompts(9, "train", 2)
    expected = distill_cli.distill(model, tokenizer, prompts, max_new_tokens=6, batch_size=4, temperature=1.0, seed=2)
    got = answer_shards.read(folder, None)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected]
    assert [r["category"] for r in got] == [p["category"] for p in prompts]
