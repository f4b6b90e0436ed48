"""The head shipped for the default model: attached by default, drafting over its vocabulary subset, never changing
greedy output, and good enough that its drafts are accepted (a head that does not fit the trunk would give ~1.0)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax.decode import stats
from mtp_jax.decode.prompts import encode_prompts, pad_batch
from mtp_jax.loading.heads import DEFAULT_HEAD, HEAD_CONFIG, head_for

PROMPTS = ["Write a Python function that checks whether a number is prime.", "What is 17 times 23? Show your steps."]

pytestmark = pytest.mark.usefixtures("optimized_compiles")  # conftest.py


def test_the_default_model_has_a_shipped_head():
    assert os.path.isfile(os.path.join(DEFAULT_HEAD, HEAD_CONFIG))
    assert head_for(None) == DEFAULT_HEAD


@pytest.mark.slow
def test_shipped_head_drafts_are_accepted_and_output_equals_plain(smollm2_path):
    from mtp_jax.loading import checkpoint

    model, tokenizer = checkpoint.load(None, dtype="float32")
    assert model.config.has_mtp and model.draft_vocab is not None
    prompts = encode_prompts(PROMPTS, tokenizer, chat=True, vocab_size=model.config.vocab_size, context=8192)
    ids, lens = pad_batch(prompts, len(prompts), max(len(p.token_ids) for p in prompts))
    outputs = {}
    for k in (0, 3):
        cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=40)
        outputs[k] = mtp_jax.generate(model, ids, lens, jax.random.key(0), cfg)
    for row in range(len(PROMPTS)):
        plain = np.asarray(outputs[0].tokens[row, : outputs[0].lengths[row]])
        mtp = np.asarray(outputs[3].tokens[row, : outputs[3].lengths[row]])
        np.testing.assert_array_equal(mtp, plain, err_msg=f"prompt {row}")
    counters = stats.add(None, outputs[3].stats)
    mean_accepted = counters["emitted"] / counters["row_rounds"]  # tokens per row and verify round
    assert mean_accepted > 1.5, counters
