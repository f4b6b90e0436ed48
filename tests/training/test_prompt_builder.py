"""The offline prompt sets: reproducible, every category, and eval disjoint from train."""

from __future__ import annotations

import json
import os

import numpy as np

import mtp_jax
from mtp_jax.training.prompt_builder import CATEGORIES, MIXED_CATEGORIES, build_prompts, candidate_prompts

EVAL_FILE = os.path.join(os.path.dirname(mtp_jax.__file__), "data", "eval_prompts.jsonl")
SHIPPED_SHARD = os.path.join(  # the repository's data (not the package's): the shards the shipped head trained on
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "mtp_jax", "data", "head_answers", "train-seed0-t0-max256-0000000-0000256.npz",
)  # fmt: skip


def test_train_and_eval_are_disjoint_and_reproducible():
    train = {p for c in CATEGORIES for p in candidate_prompts(c, "train")}
    evaluation = {p for c in CATEGORIES for p in candidate_prompts(c, "eval")}
    assert not train & evaluation
    assert len(train) > 1000 and len(evaluation) > 100
    assert build_prompts(50, "train", seed=3) == build_prompts(50, "train", seed=3)
    assert build_prompts(50, "train", seed=3) != build_prompts(50, "train", seed=4)


def test_shipped_eval_prompts_cover_all_categories_and_never_appear_in_training():
    with open(EVAL_FILE) as f:
        shipped = [json.loads(line) for line in f]
    assert {p["category"] for p in shipped} == set(MIXED_CATEGORIES)  # the 40 held out since the first head
    train = {p for c in CATEGORIES for p in candidate_prompts(c, "train")}
    assert not {p["prompt"] for p in shipped} & train


def test_a_longer_prompt_list_extends_a_shorter_one():
    """`distill --start N` extends a data set made with `--num-prompts N`: that needs a seed's list to be the same
    whatever its length."""
    assert build_prompts(300, "train", seed=0)[:120] == build_prompts(120, "train", seed=0)


def test_a_list_of_other_categories_leaves_the_default_mix_as_the_shipped_shards_have_it():
    """A category added later ("explain") is mixed only when asked for: the default list is still the one the
    shipped answer shards were made from, prompt for prompt (their categories interleaved in its order)."""
    with np.load(SHIPPED_SHARD) as shard:
        shipped = [CATEGORIES[i] for i in shard["categories"]]
        assert shard["prompt_index"].tolist() == list(range(256))
    assert [p["category"] for p in build_prompts(256, "train", seed=0)] == shipped
    assert build_prompts(256, "train", seed=0) == build_prompts(256, "train", 0, MIXED_CATEGORIES)
    explain = build_prompts(40, "eval", seed=0, categories=("explain",))
    assert {p["category"] for p in explain} == {"explain"} and len({p["prompt"] for p in explain}) == 40
    assert not {p["prompt"] for p in explain} & set(candidate_prompts("explain", "train"))
    assert "speculative decoding" not in " ".join(candidate_prompts("explain", "train"))  # the README's question


def test_distill_start_out_of_range_is_one_line(tmp_path, capsys):
    from mtp_jax.cli.distill import main

    assert main(["--out", str(tmp_path / "d.jsonl"), "--num-prompts", "4", "--start", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--start" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "d.jsonl").exists()
    assert main(["--out", str(tmp_path / "d.jsonl"), "--categories", "chat,poems"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--categories" in err and "explain" in err and len(err.splitlines()) == 1


def test_buckets_pad_by_at_most_a_third_and_stay_few():
    from mtp_jax.decode.prompts import bucket

    widths = {bucket(n) for n in range(1, 1025)}
    assert sorted(widths) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert all(bucket(n) >= n and (n <= 16 or bucket(n) * 2 < n * 3) for n in range(1, 1025))
    assert [bucket(n, minimum=32) for n in (1, 33, 49, 70)] == [32, 48, 64, 96]
