"""The real default model: our plain greedy decode equals transformers' greedy decode of the same GGUF."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import mtp_jax
from mtp_jax.decode.prompts import encode_prompts, pad_batch

PROMPTS = [
    "What is the capital of France? Answer, then describe the city.",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]
NEW_TOKENS = 40

pytestmark = pytest.mark.usefixtures("optimized_compiles", "one_torch_thread")  # conftest.py


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(default_model, hf_model):
    model, tokenizer = default_model
    prompts = encode_prompts(PROMPTS, tokenizer, chat=True, vocab_size=model.config.vocab_size, context=8192)
    ids, lens = pad_batch(prompts, len(prompts), max(len(p.token_ids) for p in prompts))
    cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    out = mtp_jax.generate(model, ids, lens, jax.random.key(0), cfg)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = hf_model.generate(
                torch.tensor([prompt.token_ids]),
                attention_mask=torch.ones(1, len(prompt.token_ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,  # generate past EOS as ours does with stop_on_eos=False
                pad_token_id=0,
            )[0, len(prompt.token_ids) :].tolist()
        ours = np.asarray(out.tokens[row]).tolist()
        assert len(reference) == NEW_TOKENS
        assert ours == reference, f"prompt {row}: {tokenizer.decode(ours)!r} vs {tokenizer.decode(reference)!r}"


@pytest.mark.slow
def test_prompt_logits_match_transformers(default_model, hf_model):
    from mtp_jax.models.kv_cache import KVCache

    model, tokenizer = default_model
    ids = tokenizer(PROMPTS[1])["input_ids"]
    cache = (KVCache.zeros(model.config.num_layers, 1, 64, model.config, model.dtype),)
    hidden, _ = model.trunk(np.asarray([ids]), np.arange(len(ids))[None], cache)
    ours = np.asarray(model.logits(hidden))[0]
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, atol=2e-3, rtol=1e-3)
