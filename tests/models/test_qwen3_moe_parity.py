"""Qwen3-MoE trunks against transformers' `Qwen3MoeForCausalLM` on tiny random checkpoints in the released key
layout (transformers writes the experts back per expert): config, block by block, full logits (a prefill's
grouped matmuls too), greedy tokens. Two configs: the released form (every layer routed, picked probabilities
renormalised) and a dense first layer with the picks not renormalised and attention biases."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from mtp_jax.conversion.export import hf_config
from mtp_jax.families.registry import model_config_from_hf
from mtp_jax.runtime.errors import ConversionError
from tests.support.long_cache import check_logits_after_a_long_cache
from tests.support.parity_helpers import (
    check_block_by_block,
    check_full_logits,
    check_greedy_batch,
    hf_greedy,
    save_and_load,
)
from tests.support.prompts import padded_prompts, random_tokens

TOL = dict(atol=2e-5, rtol=2e-5)
SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
    max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    eos_token_id=None, bos_token_id=None,
)  # fmt: skip
VARIANTS = {
    "released": dict(norm_topk_prob=True),
    "dense_first": dict(norm_topk_prob=False, mlp_only_layers=[0], attention_bias=True),
}
LOGITS_LEN = 12
NEW_TOKENS = 16
PROMPT_LENS = (5, 12, 9)
VOCAB = SHAPE["vocab_size"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def random_hf_model(variant: str, seed: int = 0):
    """Every parameter ~ N(0, 0.1), norm scales ~ N(1, 0.1); the routers ~ N(0, 1), so that the picks are
    decided (not near ties) and their weights far from uniform. float32, eager attention."""
    config = Qwen3MoeConfig(**SHAPE, **VARIANTS[variant])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 1.0 if name.endswith("mlp.gate.weight") else 0.1)
    return model.float().eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved folder, the saved config.json dict)."""
    hf = random_hf_model(request.param)
    model, saved = save_and_load(hf, tmp_path_factory.mktemp(request.param))
    return hf, model, saved


@pytest.mark.slow
def test_config_maps(pair):
    hf, model, saved = pair
    cfg, ref = model.config, hf.config
    assert cfg == model_config_from_hf(saved) and cfg.family == "qwen3_moe" and cfg.qk_norm and not cfg.has_mtp
    assert (cfg.moe.num_experts, cfg.moe.experts_per_token) == (ref.num_experts, ref.num_experts_per_tok)
    assert cfg.moe.norm_topk_prob == ref.norm_topk_prob and cfg.moe.scoring == "softmax"
    dense = len(ref.mlp_only_layers)
    expected = [("dense", 0, 1), ("softmax_moe", 1, 2)] if dense else [("softmax_moe", 0, 3)]
    assert [(s.kind.mlp, s.start, s.count) for s in cfg.segments()] == expected
    assert cfg.qkv_bias == cfg.o_bias == ref.attention_bias


@pytest.mark.slow
def test_block_by_block(pair):
    hf, model, _ = pair
    check_block_by_block(hf, model, random_tokens(1, (3, LOGITS_LEN), VOCAB), TOL)


@pytest.mark.slow
def test_full_logits(pair):
    hf, model, _ = pair
    check_full_logits(hf, model, random_tokens(2, (3, LOGITS_LEN), VOCAB), TOL)


@pytest.mark.slow
def test_logits_after_a_long_cache(pair):
    """A prefill of 2 x 290 rows (the routed experts as grouped matmuls) then blocks over the cache."""
    hf, model, _ = pair
    check_logits_after_a_long_cache(hf, model, random_tokens(4, (2, 300), VOCAB))


@pytest.mark.slow
def test_greedy_tokens(pair):
    """3 right-padded prompts of different lengths in one batch; transformers runs each alone."""
    hf, model, _ = pair
    ids = padded_prompts(3, PROMPT_LENS, VOCAB)
    references = [hf_greedy(hf, ids[row, :n], NEW_TOKENS) for row, n in enumerate(PROMPT_LENS)]
    check_greedy_batch(model, ids, PROMPT_LENS, references, NEW_TOKENS)


def released_config(**changes) -> dict:
    """Qwen3-30B-A3B's config.json (its fields as released), with `changes`."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    return {**config, **changes}


def test_the_released_config_maps():
    cfg = model_config_from_hf(released_config())
    assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe.expert_intermediate_size) == (128, 8, 768)
    assert cfg.moe.norm_topk_prob and cfg.moe.first_dense_layers == 0 and cfg.qk_norm and not cfg.qkv_bias
    assert [(s.kind.mlp, s.count) for s in cfg.segments()] == [("softmax_moe", 48)]
    assert model_config_from_hf(released_config(mlp_only_layers=[0, 1])).moe.first_dense_layers == 2
    assert model_config_from_hf(released_config(num_experts=0)).moe is None
    renamed = {k: v for k, v in released_config().items() if k != "num_experts"}
    assert model_config_from_hf({**renamed, "num_local_experts": 128}) == cfg  # as transformers 5 writes it
    with pytest.raises(ConversionError, match="num_experts must be an integer >= 0"):
        model_config_from_hf({**renamed, "num_local_experts": -1})


@pytest.mark.parametrize(
    "changes, why",
    [
        (dict(decoder_sparse_step=2), r"dense layers \[0, 2, 4"),
        (dict(mlp_only_layers=[3]), r"dense layers \[3\]"),
        (dict(mlp_only_layers="0"), "mlp_only_layers must be a list"),
        (dict(num_experts_per_tok=129), "num_experts_per_tok"),
        (dict(shared_expert_intermediate_size=512), "does not handle: shared_expert_intermediate_size"),
        (dict(num_local_experts=64), r"num_experts \(128\) and num_local_experts \(64\) differ"),
    ],
)
def test_what_is_not_supported_is_refused_in_one_line(changes, why):
    with pytest.raises(ConversionError, match=why) as refused:
        model_config_from_hf(released_config(**changes))
    assert "\n" not in str(refused.value)


def test_an_exported_config_maps_back():
    for changes in ({}, dict(mlp_only_layers=[0, 1], norm_topk_prob=False), dict(num_experts=0)):
        cfg = model_config_from_hf(released_config(**changes))
        assert model_config_from_hf(hf_config(cfg)) == cfg
    assert hf_config(model_config_from_hf(released_config()))["mlp_only_layers"] == []
