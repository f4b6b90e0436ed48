"""tunix's dense trunks mapped onto `CausalLM`: the same logits as tunix's own forward (tiny random configs, float32,
rope_theta other than tunix's default so that a forward reading the wrong base shows)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="tunix comes with the `rl` extra; .ci/run tests it in an environment of its own")

from tunix.models.llama3 import model as llama3
from tunix.models.qwen3 import model as qwen3

from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.rl.tunix_export import tunix_model_from_causal_lm
from mtp_jax.rl.tunix_models import causal_lm_from_tunix, trunk_config
from mtp_jax.runtime.errors import UserError
from tests.rl.tunix_support import tiny_tunix_model
from tests.support.tiny_models import tiny_config


def tunix_logits(model, tokens: jax.Array) -> jax.Array:
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((width, width), bool)), (batch, width, width))
    logits, _ = model(tokens, positions, None, mask)
    return logits


def our_logits(model, tokens: jax.Array) -> jax.Array:
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    hidden, _ = model.trunk(tokens, positions, model.new_cache(batch, width))
    return model.logits(hidden)


@pytest.mark.parametrize("family", ["llama3", "llama3-tied", "qwen2", "qwen3"])
def test_a_mapped_tunix_trunk_gives_tunix_s_logits(family):
    tunix_model = tiny_tunix_model(family, seed=1)
    ours = causal_lm_from_tunix(tunix_model, eos_token_ids=(2,), context=64)
    tokens = jax.random.randint(jax.random.key(0), (3, 40), 0, tunix_model.config.vocab_size)
    expected = np.asarray(tunix_logits(tunix_model, tokens))
    got = np.asarray(our_logits(ours, tokens))
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)


def test_the_mapped_config_keeps_tunix_s_shape_and_stops_at_the_given_eos():
    tunix_model = tiny_tunix_model("qwen2", seed=0)
    cfg = trunk_config(tunix_model, eos_token_ids=(2, 5), context=128)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.qkv_bias) == ("qwen2", 2, 32, True)
    assert cfg.eos_token_ids == (2, 5) and cfg.max_position_embeddings == 128 and not cfg.has_mtp


def test_a_model_that_is_not_tunix_s_is_refused():
    with pytest.raises(UserError, match="cannot be mapped"):
        trunk_config(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), eos_token_ids=(1,), context=8)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_causal_lm_exported_to_tunix_computes_its_logits_and_maps_back_to_itself(family, monkeypatch):
    cfg = tiny_config(vocab=48).replace(family=family, qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
                                        mtp=None, rope=tiny_config().rope)  # fmt: skip
    ours = CausalLM(cfg, rngs=nnx.Rngs(4))
    for proj in (ours.segments[0].layers.attn.q_proj, ours.segments[0].layers.attn.k_proj):
        proj[...] = proj[...] * 4.0  # attention that depends on positions (see tiny_tunix_model)
    if family != "qwen2":  # tunix's forward ignores the config's base: refused until it is set
        with pytest.raises(UserError, match="rotary base"):
            tunix_model_from_causal_lm(ours)
        module = llama3 if family == "llama" else qwen3
        monkeypatch.setattr(module, "apply_rope", functools.partial(module.apply_rope, rope_theta=cfg.rope.theta))
    exported = tunix_model_from_causal_lm(ours)
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 48)
    np.testing.assert_allclose(np.asarray(tunix_logits(exported, tokens)), np.asarray(our_logits(ours, tokens)),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    back = causal_lm_from_tunix(exported, eos_token_ids=cfg.eos_token_ids, context=cfg.max_position_embeddings)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ours)), nnx.to_flat_state(nnx.state(back)), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(path))
