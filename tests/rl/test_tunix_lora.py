"""`MtpRollout` on a policy tunix trains through qwix LoRA (adapters on every projection and the lm_head, scale
alpha / rank = 2): greedy rollouts token for token tunix's own vanilla rollout's with the same LoRA model, before and
after a LoRA weight sync as tunix's `RLCluster.sync_weights` makes it (the adapters alone), the trainer's model never
touched; the mapped trunk's logits those of tunix's LoRA forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="tunix comes with the `rl` extra; .ci/run tests it in an environment of its own")

import qwix
from tunix.rl import utils as rl_utils

from mtp_jax.rl.tunix_models import causal_lm_from_tunix
from mtp_jax.runtime.errors import UserError
from tests.rl.test_tunix_models import our_logits, tunix_logits
from tests.rl.test_tunix_rollout import PROMPTS, as_tunix_syncs_weights, ours, rollout_config, vanilla
from tests.rl.tunix_support import tiny_tunix_model

RANK, ALPHA = 4, 8.0  # each adapter scaled by 2: one merged unscaled shows
TARGETS = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|lm_head)"


def with_lora(model, seed: int = 0, spread: float = 0.02):
    """A copy of tunix `model` (`model` is kept) with qwix LoRA adapters on TARGETS, moved by `lora_step` off qwix's
    initial ones (B zero: no change), so that they change the policy."""
    provider = qwix.LoraProvider(module_path=TARGETS, rank=RANK, alpha=ALPHA)
    example = {"input_tokens": jnp.ones((1, 1), jnp.int32), "positions": jnp.zeros((1, 1), jnp.int32),
               "cache": None, "attention_mask": jnp.ones((1, 1, 1), bool)}  # fmt: skip
    lora = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(seed), **example)
    lora_step(lora, seed, spread)
    return lora


def lora_step(model, seed: int, spread: float) -> None:
    """What a LoRA training step changes, in place: each of `model`'s adapters (A and B) moved by normal noise of
    `spread`, its other parameters kept."""
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.LoRAParam))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + spread * jax.random.normal(key, x.shape, x.dtype) for x, key in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, moved))


def greedy(engine) -> list[list[int]]:
    return [t.tolist() for t in engine.generate(PROMPTS, rollout_config(0.0)).tokens]


@pytest.fixture(scope="module")
def base():
    return tiny_tunix_model("llama3", seed=3, context_scale=0.3, logit_scale=32.0)


def test_greedy_rollouts_of_a_lora_policy_are_tunix_s_token_for_token(base):
    policy = with_lora(base)
    got = greedy(ours(policy, lora_alpha=ALPHA, slots=3))
    assert got == greedy(vanilla(policy))
    assert got != greedy(vanilla(base))  # the adapters matter


def test_a_lora_sync_moves_the_rollouts_to_the_trained_adapters_and_leaves_the_trainer_s_model_alone(base):
    trainer = with_lora(base)  # colocated, tunix hands the rollout engine the trainer's own model
    engine = ours(trainer, lora_alpha=ALPHA)
    assert not rl_utils.is_sharing_weights(trainer, engine.model())  # so tunix's learner syncs weights
    assert rl_utils.is_sharing_backbone(trainer, engine.model())  # the frozen trunk is not copied
    before = greedy(engine)
    lora_step(trainer, seed=1, spread=0.02)
    kept = jax.tree.map(np.asarray, nnx.state(trainer))
    filter_types = (nnx.LoRAParam,)  # RLCluster.sync_weights for a policy with LoRA adapters
    with as_tunix_syncs_weights():
        engine.update_params(nnx.state(trainer, filter_types), filter_types)
    after = greedy(engine)
    assert after != before
    assert after == greedy(vanilla(trainer))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(trainer)), kept)


@pytest.mark.parametrize("family", ["llama3", "llama3-tied", "qwen2", "qwen3"])
def test_a_mapped_lora_trunk_gives_tunix_s_lora_logits(family):
    policy = with_lora(tiny_tunix_model(family, seed=1), seed=2)
    ours_ = causal_lm_from_tunix(policy, eos_token_ids=(2,), context=64, lora_alpha=ALPHA)
    tokens = jax.random.randint(jax.random.key(0), (3, 40), 0, policy.config.vocab_size)
    np.testing.assert_allclose(np.asarray(our_logits(ours_, tokens)), np.asarray(tunix_logits(policy, tokens)),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_lora_without_its_alpha_and_syncs_of_other_variables_are_refused(base):
    policy = with_lora(base)
    with pytest.raises(UserError, match="lora_alpha"):
        causal_lm_from_tunix(policy, eos_token_ids=(2,), context=64)
    engine = ours(base)
    with pytest.raises(UserError, match="LoRA adapters"):
        engine.update_params(nnx.state(base, nnx.BatchStat), (nnx.BatchStat,))
