"""tunix's routed Qwen3 (`num_experts` set: a MoELayer in every layer) mapped onto `CausalLM` (family qwen3_moe): the
logits of tunix's own forward, through both ways this project runs the experts; `MtpRollout`'s greedy rollouts
tunix's `VanillaRollout`'s token for token, before and after a weight sync; LoRA adapters on the attention and the
router merged, adapters on the experts refused (tiny random configs, float32, 6 experts, 2 picked per token)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="tunix comes with the `rl` extra; .ci/run tests it in an environment of its own")

import qwix

from mtp_jax.models.moe import DENSE_EXPERT_ROWS
from mtp_jax.rl.tunix_models import causal_lm_from_tunix, trunk_config
from mtp_jax.runtime.errors import UserError
from tests.rl.test_tunix_lora import ALPHA, RANK, lora_step
from tests.rl.test_tunix_models import our_logits, tunix_logits
from tests.rl.test_tunix_rollout import PROMPTS, as_tunix_syncs_weights, ours, rollout_config, vanilla
from tests.rl.tunix_support import ROUTED, SHAPE, tiny_tunix_model

WIDTH = 40


@pytest.fixture(scope="module")
def routed():
    return tiny_tunix_model("qwen3-moe", seed=1)


@pytest.fixture(scope="module")
def policy():
    """A near-bigram routed policy whose greedy answers `predictable_head` mostly drafts right (tunix draws its
    embedding at 0.01: the layers' outputs must be far smaller than the dense tests' 0.3 for that); its routing
    still matters (the weight sync test moves it)."""
    return tiny_tunix_model("qwen3-moe", seed=3, context_scale=0.005, logit_scale=32.0)


def greedy(engine) -> list[list[int]]:
    return [t.tolist() for t in engine.generate(PROMPTS, rollout_config(0.0)).tokens]


def test_the_routed_qwen3_maps_onto_qwen3_moe(routed):
    cfg = trunk_config(routed, eos_token_ids=(2,), context=64)
    assert cfg.family == "qwen3_moe" and cfg.qk_norm and not cfg.has_mtp
    m = cfg.moe
    expected = (ROUTED["num_experts"], ROUTED["num_experts_per_tok"], SHAPE["hidden_dim"], True, 0, "softmax")
    assert (m.num_experts, m.experts_per_token, m.expert_intermediate_size, m.norm_topk_prob,
            m.first_dense_layers, m.scoring) == expected  # fmt: skip
    assert [(s.kind.mlp, s.count) for s in cfg.segments()] == [("softmax_moe", SHAPE["num_layers"])]


@pytest.mark.parametrize("batch", [2, 5])  # 80 rows: every expert on every row; 200: grouped matmuls
def test_a_mapped_routed_qwen3_gives_tunix_s_logits(routed, batch):
    assert (batch * WIDTH > DENSE_EXPERT_ROWS) == (batch == 5)
    mapped = causal_lm_from_tunix(routed, eos_token_ids=(2,), context=64)
    tokens = jax.random.randint(jax.random.key(batch), (batch, WIDTH), 0, routed.config.vocab_size)
    expected = np.asarray(tunix_logits(routed, tokens))
    np.testing.assert_allclose(np.asarray(our_logits(mapped, tokens)), expected, atol=1e-5, rtol=1e-5)
    moe = mapped.segments[0].layers.mlp  # the routing counts: without the renormalisation, other logits
    moe.routing = dataclasses.replace(moe.routing, norm_topk_prob=False)
    assert np.abs(np.asarray(our_logits(mapped, tokens)) - expected).max() > 1e-2


def test_greedy_rollouts_of_a_routed_policy_equal_tunix_s_token_for_token(policy):
    engine = ours(policy, slots=3)  # fewer slots than prompts: rows refill
    got = engine.generate(PROMPTS, rollout_config(0.0))
    expected = vanilla(policy).generate(PROMPTS, rollout_config(0.0))
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in expected.tokens]
    assert got.text == expected.text
    assert engine.last_stats["accepted"] > engine.last_stats["drafted"] // 2  # the drafts did the work


def test_a_weight_sync_of_a_routed_policy_moves_the_rollouts_to_the_new_routing(policy):
    engine = ours(policy)
    before = greedy(engine)
    graphdef, state = nnx.split(policy)
    trainer = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    for i, layer in enumerate(trainer.layers):  # a policy step that moved the routers and the experts
        for w in (layer.mlp.router.kernel, layer.mlp.down_proj):
            w[...] = w[...] + 2.0 * jnp.std(w[...]) * jax.random.normal(jax.random.key(i), w[...].shape)
    with as_tunix_syncs_weights():
        engine.update_params(nnx.state(trainer, nnx.Param), (nnx.Param,))
    after = greedy(engine)
    assert after != before and after == greedy(vanilla(trainer))


def with_lora(model, targets: str, seed: int = 2):
    """A copy of tunix `model` with qwix LoRA adapters on the modules `targets` names, moved off qwix's initial ones
    (`lora_step`)."""
    provider = qwix.LoraProvider(module_path=targets, rank=RANK, alpha=ALPHA)
    example = {"input_tokens": jnp.ones((1, 1), jnp.int32), "positions": jnp.zeros((1, 1), jnp.int32),
               "cache": None, "attention_mask": jnp.ones((1, 1, 1), bool)}  # fmt: skip
    lora = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(seed), **example)
    lora_step(lora, seed, spread=0.05)
    return lora


def test_lora_on_the_attention_and_the_router_is_merged_into_tunix_s_lora_logits(routed):
    policy = with_lora(routed, ".*(q_proj|k_proj|v_proj|o_proj|router|lm_head)")
    paths = {".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(nnx.state(policy, nnx.LoRAParam))}
    assert "layers.1.mlp.router.kernel_lora_a" in paths and "layers.0.attn.q_proj.w_lora_b" in paths
    mapped = causal_lm_from_tunix(policy, eos_token_ids=(2,), context=64, lora_alpha=ALPHA)
    tokens = jax.random.randint(jax.random.key(0), (3, WIDTH), 0, policy.config.vocab_size)
    expected = np.asarray(tunix_logits(policy, tokens))
    np.testing.assert_allclose(np.asarray(our_logits(mapped, tokens)), expected, atol=1e-5, rtol=1e-5)
    assert np.abs(expected - np.asarray(tunix_logits(routed, tokens))).max() > 1e-2  # the adapters matter


def test_lora_on_the_experts_is_refused(routed):
    graphdef, state = nnx.split(routed)
    policy = nnx.merge(graphdef, state)
    e, d, f = policy.layers[0].mlp.gate_proj[...].shape
    policy.layers[0].mlp.gate_proj_lora_a = nnx.LoRAParam(jnp.zeros((e, d, RANK)))  # as an adapter would be held
    policy.layers[0].mlp.gate_proj_lora_b = nnx.LoRAParam(jnp.zeros((RANK, f)))
    with pytest.raises(UserError, match=r"LoRA adapters on layers\.0\.mlp\.gate_proj are not merged"):
        causal_lm_from_tunix(policy, eos_token_ids=(2,), context=64, lora_alpha=ALPHA)
