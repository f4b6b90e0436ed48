"""The offline prompt sets: reproducible, all four categories, and eval disjoint from train."""

from __future__ import annotations

import json
import os

import mtp_jax
from mtp_jax.data.prompt_builder import CATEGORIES, build_prompts, candidate_prompts

EVAL_FILE = os.path.join(os.path.dirname(mtp_jax.__file__), "data", "eval_prompts.jsonl")


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
    assert {p["category"] for p in shipped} == set(CATEGORIES)
    train = {p for c in CATEGORIES for p in candidate_prompts(c, "train")}
    assert not {p["prompt"] for p in shipped} & train
