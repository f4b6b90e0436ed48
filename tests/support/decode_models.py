"""Three predictable models with an MTP head (a GQA trunk, latent attention with routed experts, a hybrid trunk of
gated DeltaNet and gated attention), prompts of mixed lengths for them, and their greedy decode: the layer-layout
tests' models, which the quantization tests decode too."""

from __future__ import annotations

import jax
import numpy as np

import mtp_jax
from tests.support.hybrid_models import predictable_hybrid_model
from tests.support.prompts import padded_prompts
from tests.support.tiny_models import predictable_model, predictable_moe_model

PROMPT_LENS = np.array([7, 2, 11, 5], np.int32)
MODELS = {
    "gqa": lambda: predictable_model("deepseek", seed=1),
    "mla_moe": lambda: predictable_moe_model("deepseek_v3", seed=2),
    "hybrid": lambda: predictable_hybrid_model(seed=3),
}


def prompts_for(model) -> np.ndarray:
    return padded_prompts(5, PROMPT_LENS, model.config.vocab_size)


def decode(model, prompts, k: int):
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=20)
    return jax.tree.map(np.asarray, mtp_jax.generate(model, prompts, PROMPT_LENS, jax.random.key(0), cfg))
