"""Greedy MTP decoding of the MoE families (tiny configs: DeepSeek-V3 with MLA, GLM-4.5 with partial-rotary GQA)
gives exactly plain greedy's tokens, batch 4 of mixed prompt lengths, with drafts accepted and rejected: k = 1..3
for DeepSeek (latent cache), k = 3 for GLM (its GQA cache rolls back as the dense families' do; each k is a
compile)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import mtp_jax
from tests.support.prompts import padded_prompts
from tests.support.tiny_models import predictable_moe_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PROMPT_LENS = np.array([3, 9, 1, 6], np.int32)
DRAFTS = {"deepseek_v3": (1, 2, 3), "glm4_moe": (3,)}


@pytest.mark.parametrize("family", sorted(DRAFTS))
def test_mtp_greedy_equals_plain_greedy(family):
    model = predictable_moe_model(family)
    prompts = padded_prompts(3, PROMPT_LENS, model.config.vocab_size)

    def decode(k: int):
        cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=NEW_TOKENS)
        return jax.tree.map(np.asarray, mtp_jax.generate(model, prompts, PROMPT_LENS, jax.random.key(0), cfg))

    plain = decode(0)
    assert (plain.lengths == NEW_TOKENS).all()
    for k in DRAFTS[family]:
        out = decode(k)
        np.testing.assert_array_equal(out.tokens, plain.tokens, err_msg=f"k={k}")
        np.testing.assert_array_equal(out.lengths, plain.lengths, err_msg=f"k={k}")
        assert out.stats.accepted_at[0] > 0, (k, out.stats.accepted_at)
        assert out.stats.accepted < out.stats.drafted, k  # some drafts rejected too: both paths exercised
