"""Greedy MTP decoding of the MoE families (tiny configs: DeepSeek-V3 with MLA, GLM-4.5 with partial-rotary GQA)
gives exactly plain greedy's tokens, batch 4 of mixed prompt lengths, with drafts accepted and rejected: k = 1..3
for DeepSeek (latent cache), k = 3 for GLM (its GQA cache rolls back as the dense families' do; each k is a
compile)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.families.registry import model_config_from_hf, tiny_configs
from tests.prompts import padded_prompts

NEW_TOKENS = 24
PROMPT_LENS = np.array([3, 9, 1, 6], np.int32)
DRAFTS = {"deepseek_v3": (1, 2, 3), "glm4_moe": (3,)}


def _scale_outputs(layers, factor: float) -> None:
    """Scale what a stack of layers adds to the residual stream: attention and MLP (experts included) outputs."""
    layers.attn.o_proj[...] = layers.attn.o_proj[...] * factor
    mlp = layers.mlp
    if hasattr(mlp, "expert_down"):
        mlp.expert_down[...] = mlp.expert_down[...] * factor
        mlp.shared.down_proj[...] = mlp.shared.down_proj[...] * factor
    else:
        mlp.down_proj[...] = mlp.down_proj[...] * factor


def predictable_moe_model(family: str, seed: int = 0) -> mtp_jax.CausalLM:
    """A near-bigram trunk and an MTP head wired to apply the same bigram map to its input token (the embedding
    half of the fusion projection is the identity, its layer nearly silent), so drafts are often right."""
    cfg = model_config_from_hf(tiny_configs()[family]).replace(eos_token_ids=())
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(seed))
    for segment in model.segments:
        _scale_outputs(segment.layers, 0.3)
    d = cfg.hidden_size
    select_token = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)  # [2D, D]: [e, h] -> e
    model.mtp.proj[...] = select_token + 0.02 * jax.random.normal(jax.random.key(seed), select_token.shape)
    _scale_outputs(model.mtp.block.layers, 0.02)
    return model


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
