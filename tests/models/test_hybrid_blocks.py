"""The Qwen3-Next / Qwen3.5 blocks other than the gated DeltaNet against transformers' PyTorch modules on tiny random
configs, float32: the zero-centred RMSNorm, gated full attention (partial rotary, a prompt then a block over the
cache), and the softmax-routed MoE with its gated shared expert (fused experts)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_35
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_35_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from mtp_jax.config.model import ModelConfig, MoeConfig, RopeConfig
from mtp_jax.families import qwen_hybrid_layout as layout
from mtp_jax.models.gated_attention import GatedAttention
from mtp_jax.models.layers import rope_inverse_frequencies, rope_tables
from mtp_jax.models.norms import ZeroCenteredRMSNorm
from mtp_jax.models.softmax_moe import SoftmaxMoE
from tests.support.parity_helpers import normal_inputs, state_dict_numpy, to_numpy

TOL = dict(rtol=1e-4, atol=1e-5)
SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=12, shared_expert_intermediate_size=24)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def _ours_config(hf, moe: MoeConfig | None = None) -> ModelConfig:
    return ModelConfig(
        family=hf.model_type,
        vocab_size=16,
        hidden_size=hf.hidden_size,
        intermediate_size=16,
        num_layers=1,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope=RopeConfig(
            theta=hf.rope_parameters["rope_theta"], partial_factor=hf.rope_parameters["partial_rotary_factor"]
        ),
        qk_norm=True,
        moe=moe,
    )


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


def _close(ours, ref: torch.Tensor) -> None:
    np.testing.assert_allclose(np.asarray(ours), to_numpy(ref), **TOL)


def test_zero_centered_rms_norm():
    norm = _randomize(hf_next.Qwen3NextRMSNorm(16, eps=1e-6), 0)
    ours = ZeroCenteredRMSNorm(16, 1e-6)
    ours.scale[...] = jnp.asarray(state_dict_numpy(norm)["weight"])
    x = normal_inputs(0, (2, 5, 16))
    with torch.no_grad():
        _close(ours(jnp.asarray(x.numpy())), norm(x))


ATTENTION = {
    "qwen3_next": (Qwen3NextConfig, hf_next.Qwen3NextAttention, hf_next.Qwen3NextRotaryEmbedding),
    "qwen3_5": (Qwen3_5TextConfig, hf_35.Qwen3_5Attention, hf_35.Qwen3_5TextRotaryEmbedding),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(ATTENTION))
def test_gated_attention(family):
    """A 9-token prompt over an empty cache, then a 3-token block over the prompt's cached keys (stale slots after
    it hold garbage), against transformers' eager attention over all 12 tokens; rotary on the leading quarter of
    each head (Qwen3.5: the text case of its interleaved mrope)."""
    config_class, attention_class, rotary_class = ATTENTION[family]
    hf_cfg = config_class(**SHAPE, vocab_size=16, num_hidden_layers=1, attn_implementation="eager")
    hf_attn = _randomize(attention_class(hf_cfg, layer_idx=0), 1)
    cfg = _ours_config(hf_cfg)
    assert cfg.rotary_dim == SHAPE["head_dim"] // 4
    sd = state_dict_numpy(hf_attn)
    ours = GatedAttention(cfg, dtype=jnp.float32, rngs=None)
    q, gate = layout.gated_query(sd["q_proj.weight"], cfg.num_heads, cfg.head_dim)
    ours.q_proj[...], ours.gate_proj[...] = jnp.asarray(q), jnp.asarray(gate)
    ours.k_proj[...] = jnp.asarray(sd["k_proj.weight"].T.reshape(ours.k_proj.shape))
    ours.v_proj[...] = jnp.asarray(sd["v_proj.weight"].T.reshape(ours.v_proj.shape))
    ours.o_proj[...] = jnp.asarray(sd["o_proj.weight"].T.reshape(ours.o_proj.shape))
    ours.q_norm.scale[...] = jnp.asarray(sd["q_norm.weight"])
    ours.k_norm.scale[...] = jnp.asarray(sd["k_norm.weight"])

    batch, prompt, total, slots = 2, 9, 12, 16
    x = normal_inputs(2, (batch, total, SHAPE["hidden_size"]))
    positions = torch.arange(total)[None].expand(batch, total)
    causal = torch.full((total, total), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = hf_attn(x, rotary_class(hf_cfg)(x, positions), attention_mask=causal)

    inv_freq = rope_inverse_frequencies(cfg.rope, cfg.rotary_dim)
    pos = jnp.asarray(positions.numpy())
    xj = jnp.asarray(x.numpy())
    cache_shape = (batch, slots, cfg.num_kv_heads, cfg.head_dim)
    garbage = jnp.asarray(np.random.default_rng(3).normal(size=cache_shape).astype(np.float32))
    out, k, v = ours(xj[:, :prompt], pos[:, :prompt], rope_tables(pos[:, :prompt], inv_freq), garbage, garbage)
    _close(out, ref[:, :prompt])
    past_k, past_v = garbage.at[:, :prompt].set(k), garbage.at[:, :prompt].set(v)
    out, _, _ = ours(xj[:, prompt:], pos[:, prompt:], rope_tables(pos[:, prompt:], inv_freq), past_k, past_v)
    _close(out, ref[:, prompt:])


MOE = {
    "qwen3_next": (Qwen3NextConfig, hf_next.Qwen3NextSparseMoeBlock, False),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, hf_35_moe.Qwen3_5MoeSparseMoeBlock, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MOE))
def test_softmax_moe(family):
    """Softmax top-3 of 8 fused experts plus the sigmoid-gated shared expert (twice an expert's width), with and
    without renormalising the picked probabilities (Qwen3.5-MoE always renormalises)."""
    config_class, block_class, norm_topk_prob = MOE[family]
    extra = {} if family == "qwen3_5_moe" else {"norm_topk_prob": norm_topk_prob}
    hf_cfg = config_class(**SHAPE, **MOE_SHAPE, **extra, vocab_size=16, num_hidden_layers=1)
    block = _randomize(block_class(hf_cfg), 2)
    shared, expert = MOE_SHAPE["shared_expert_intermediate_size"], MOE_SHAPE["moe_intermediate_size"]
    moe = MoeConfig(
        num_experts=MOE_SHAPE["num_experts"],
        experts_per_token=MOE_SHAPE["num_experts_per_tok"],
        expert_intermediate_size=expert,
        num_shared_experts=shared // expert,
        norm_topk_prob=norm_topk_prob,
    )
    ours = SoftmaxMoE(_ours_config(hf_cfg, moe), dtype=jnp.float32, rngs=None)
    sd = state_dict_numpy(block)
    gate, up, down = layout.fused_experts(sd["experts.gate_up_proj"], sd["experts.down_proj"])
    ours.expert_gate[...], ours.expert_up[...], ours.expert_down[...] = map(jnp.asarray, (gate, up, down))
    ours.router[...] = jnp.asarray(sd["gate.weight"].T)
    ours.shared.gate[...] = jnp.asarray(sd["shared_expert_gate.weight"][0])
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(ours.shared.mlp, name)[...] = jnp.asarray(sd[f"shared_expert.{name}.weight"].T)

    x = normal_inputs(4, (2, 7, SHAPE["hidden_size"]))
    with torch.no_grad():
        ref = block(x)
    _close(ours(jnp.asarray(x.numpy())), ref)
