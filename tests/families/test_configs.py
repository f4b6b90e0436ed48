"""Every family's tiny config (`Family.tiny_configs`) maps through the converter and decodes (MTP == plain when a
head)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.families.registry import model_config_from_hf, tiny_configs

pytestmark = pytest.mark.slow

CONFIGS = tiny_configs()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reference_config_maps_and_decodes(name):
    cfg = model_config_from_hf(CONFIGS[name])
    assert cfg.family == CONFIGS[name]["model_type"]
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(0))
    prompts, lens = np.array([[5, 6, 7, 8], [9, 10, 0, 0]]), np.array([4, 2])
    plain_cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=8, stop_on_eos=False)
    plain = mtp_jax.generate(model, prompts, lens, jax.random.key(0), plain_cfg)
    if cfg.has_mtp:
        mtp_cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=8, stop_on_eos=False)
        mtp = mtp_jax.generate(model, prompts, lens, jax.random.key(0), mtp_cfg)
        np.testing.assert_array_equal(np.asarray(mtp.tokens), np.asarray(plain.tokens))
    assert np.asarray(plain.lengths).tolist() == [8, 8]
