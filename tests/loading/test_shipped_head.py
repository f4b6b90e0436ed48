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
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.loading.heads import DEFAULT_HEAD, HEAD_CONFIG, head_for
from mtp_jax.quant.quantized_array import take_quantized_rows

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


@pytest.mark.slow
@pytest.mark.skipif(cpu_rows.status() != "ready", reason="the CPU row kernel is not built here")
def test_a_cpu_load_holds_the_draft_vocabulary_as_one_table(smollm2_path):
    """Where the row kernel reads the tied embedding in tiles, the load holds the draft vocabulary's rows as one table
    in tiles of their own (not gathered from the embedding on each call), giving the logits of the gathered rows."""
    from mtp_jax.loading import checkpoint

    model, _ = checkpoint.load(None, dtype="float32")
    assert model.draft_table is not None and model.draft_head().tile_axes is not None
    rows = take_quantized_rows(model.embed.get_value(), model.draft_vocab[...])  # [Vd, D], as each call gathered them
    hidden = jax.random.normal(jax.random.key(1), (4, model.config.hidden_size))
    held, gathered = model.draft_logits(hidden), model.draft_logits(hidden, rows)
    np.testing.assert_allclose(np.asarray(held), np.asarray(gathered), rtol=1e-4, atol=1e-4)
