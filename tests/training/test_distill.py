"""Self-distilled data: a prompt's sampled answer depends on the seed and the prompt, not on batching."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli.distill import distill
from tests.support.tiny_models import tiny_config

pytestmark = pytest.mark.slow


class CharTokenizer:
    """Characters to ids in 4..vocab-1; no chat template, so prompts are encoded as plain text."""

    chat_template = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text: str) -> dict:
        return {"input_ids": [4 + ord(c) % (self.vocab - 4) for c in text]}


PROMPTS = [{"prompt": text, "category": "chat"} for text in ("hi", "a longer prompt", "sum 2 and 3", "x", "why?")]


def run(model, batch_size, temperature, seed=0):
    tokenizer = CharTokenizer(model.config.vocab_size)
    return distill(model, tokenizer, PROMPTS, max_new_tokens=12, batch_size=batch_size, temperature=temperature,
                   seed=seed)  # fmt: skip


def test_sampled_answers_follow_the_seed_and_prompt_not_the_batch():
    model = mtp_jax.CausalLM(tiny_config("deepseek", vocab=64, eos=()), rngs=nnx.Rngs(0))
    sampled = run(model, batch_size=2, temperature=1.0)
    assert run(model, batch_size=3, temperature=1.0) == sampled  # other batches, other padding rows
    assert run(model, batch_size=2, temperature=1.0, seed=1) != sampled
    greedy = run(model, batch_size=2, temperature=0.0)
    assert greedy != sampled
    for record, prompt in zip(greedy, PROMPTS, strict=True):
        assert record["prompt"] == prompt["prompt"] and len(record["token_ids"]) == record["prompt_len"] + 12
    ids = np.asarray(greedy[1]["token_ids"][: greedy[1]["prompt_len"]])[None]
    cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=12)
    alone = mtp_jax.generate(model, ids, np.asarray([ids.shape[1]]), jax.random.key(5), cfg)
    assert greedy[1]["token_ids"][greedy[1]["prompt_len"] :] == np.asarray(alone.tokens)[0, :12].tolist()
