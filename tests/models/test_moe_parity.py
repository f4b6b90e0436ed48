"""DeepSeek-V3 and GLM-4.5 trunks against transformers on tiny random checkpoints in the released key layout
(per-expert keys): config, block by block (both MLA attention paths), full logits, greedy tokens."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.families.registry import model_config_from_hf
from mtp_jax.models.cache_attention import ATTENTION_CHUNK, AttentionForm
from mtp_jax.models.moe import DENSE_EXPERT_ROWS, MoE, routed_experts
from tests.support.long_cache import check_logits_after_a_long_cache
from tests.support.moe_models import FAMILIES, MOE_SHAPE, hf_config, random_hf_model
from tests.support.parity_helpers import (
    check_block_by_block,
    check_full_logits,
    check_greedy_batch,
    decoder_layer,
    hf_greedy,
    save_and_load,
)
from tests.support.prompts import padded_prompts, random_tokens

TOL = dict(atol=2e-5, rtol=2e-5)
LOGITS_LEN = 12
NEW_TOKENS = 16
PROMPT_LENS = (5, 12, 9)
VOCAB = MOE_SHAPE["vocab_size"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved folder, the saved config.json dict)."""
    hf = random_hf_model(request.param)
    model, saved = save_and_load(hf, tmp_path_factory.mktemp(request.param))
    return hf, model, saved


@pytest.mark.slow
def test_config_maps(pair):
    hf, model, saved = pair
    cfg, ref = model.config, hf.config
    assert cfg == model_config_from_hf(saved).replace(mtp=None) and cfg.family == ref.model_type
    assert cfg.moe.num_experts == ref.n_routed_experts and cfg.moe.first_dense_layers == ref.first_k_dense_replace
    assert [(s.kind.mlp, s.start, s.count) for s in cfg.segments()] == [("dense", 0, 1), ("moe", 1, 2)]
    # config.json announces one MTP layer, but transformers saves none of its tensors: loaded without a head
    assert saved["num_nextn_predict_layers"] == 1 and not cfg.has_mtp
    if cfg.family == "deepseek_v3":
        assert cfg.mla.kv_lora_rank == ref.kv_lora_rank and cfg.rope.interleaved and cfg.rope.kind == "yarn"
        assert cfg.rotary_dim == ref.qk_rope_head_dim
    else:
        assert cfg.mla is None and cfg.qk_norm and cfg.qkv_bias and not cfg.o_bias
        assert cfg.rotary_dim == ref.head_dim // 2


@pytest.mark.slow
def test_block_by_block(pair):
    """Each stage fed transformers' own input; MLA attention checked both absorbed and expanded."""
    hf, model, _ = pair
    check_block_by_block(hf, model, random_tokens(1, (3, LOGITS_LEN), VOCAB), TOL)


@pytest.mark.slow
def test_full_logits(pair):
    hf, model, _ = pair
    check_full_logits(hf, model, random_tokens(2, (3, LOGITS_LEN), VOCAB), TOL)


@pytest.mark.slow
def test_greedy_tokens(pair):
    """3 right-padded prompts of different lengths in one batch; transformers runs each alone."""
    hf, model, _ = pair
    ids = padded_prompts(3, PROMPT_LENS, VOCAB)
    references = [hf_greedy(hf, ids[row, :n], NEW_TOKENS) for row, n in enumerate(PROMPT_LENS)]
    check_greedy_batch(model, ids, PROMPT_LENS, references, NEW_TOKENS)


def _mla_inputs(pair, slots: int, positions: jax.Array, seed: int):
    """(the second layer's block, x [2, T, D], a random latent cache [2, slots, C], rope tables) for an MLA family;
    GQA families skip."""
    _, model, _ = pair
    if model.config.mla is None:
        pytest.skip("GQA family")
    layer, _ = decoder_layer(model, 1, 3, LOGITS_LEN)
    key_x, key_past = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(key_x, (2, positions.shape[1], model.config.hidden_size))
    past = jax.random.normal(key_past, (2, slots, model.config.mla.latent_dim))
    return layer, x, past, model.rope(positions)


@pytest.mark.slow
def test_mla_absorbed_equals_expanded_over_a_cache(pair):
    """With a filled cache and per-row offsets (what decode and verify see), both ways of attending agree."""
    positions = jnp.array([[6, 7, 8], [2, 3, 4]])
    layer, x, past, rope = _mla_inputs(pair, 10, positions, seed=0)
    absorbed, latents = layer.attn(x, positions, rope, past, absorb=True)
    expanded, same_latents = layer.attn(x, positions, rope, past, absorb=False)
    chex.assert_trees_all_close(absorbed, expanded, **TOL)
    chex.assert_trees_all_close(latents, same_latents, atol=0, rtol=0)
    changed = past.at[1, 4:].set(99.0)  # slots at or after row 1's first position are stale: never read
    chex.assert_trees_all_close(layer.attn(x, positions, rope, changed, absorb=True)[0], absorbed, atol=0, rtol=0)
    assert layer.attn.absorbs(1) and not layer.attn.absorbs(4096)


@pytest.mark.slow
def test_logits_after_a_long_cache(pair):
    """Blocks over a cache of two attention chunks (tests/support/long_cache.py): the chunked pass of MLA (absorbed for
    the blocks, expanded for the prefill) or of GQA."""
    hf, model, _ = pair
    check_logits_after_a_long_cache(hf, model, random_tokens(4, (2, 300), VOCAB))


@pytest.mark.slow
def test_mla_absorbed_equals_expanded_over_a_chunked_cache(pair):
    """Both ways of attending, chunk by chunk over a cache of two chunks, agree with each other and with the one-pass
    path over the same slots (a cache 16 slots shorter: not whole chunks)."""
    positions = jnp.array([[300, 301, 302], [7, 8, 9]])
    layer, x, past, rope = _mla_inputs(pair, 2 * ATTENTION_CHUNK, positions, seed=1)
    one_pass, _ = layer.attn(x, positions, rope, past[:, :-16], absorb=True)
    for absorb in (True, False):
        chunked, _ = layer.attn(x, positions, rope, past, absorb=absorb, attention=AttentionForm.CHUNKED)
        chex.assert_trees_all_close(chunked, one_pass, **TOL)


def _equations(jaxpr):
    """Every equation of a jaxpr, those inside nested jaxprs (jit, custom_jvp, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _primitives(moe: MoE, rows: int) -> list:
    return list(_equations(jax.make_jaxpr(lambda x: moe(x))(jnp.ones((1, rows, moe.expert_gate.shape[1]))).jaxpr))


def test_large_passes_run_experts_as_grouped_matmuls():
    """A pass of more than DENSE_EXPERT_ROWS rows (a prefill) sends each routed row through its own experts with
    `ragged_dot` (one grouped matmul per projection), never a dense product with every expert's weights; a smaller
    pass (a decode step) runs the dense product and no grouped matmul."""
    cfg = model_config_from_hf(hf_config("glm4_moe").to_dict())
    moe = MoE(cfg, dtype=jnp.float32, rngs=None)  # zero weights: only the traced program matters
    expert_shapes = {moe.expert_gate.shape, moe.expert_up.shape, moe.expert_down.shape}
    large = _primitives(moe, DENSE_EXPERT_ROWS + 1)
    assert [e.primitive.name for e in large].count("ragged_dot_general") == 3
    for e in large:
        if e.primitive.name == "dot_general":
            assert not {tuple(v.aval.shape) for v in e.invars} & expert_shapes, e
    small = _primitives(moe, DENSE_EXPERT_ROWS)
    assert "ragged_dot_general" not in [e.primitive.name for e in small]


@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 3])
def test_every_expert_pass_equals_grouped_pass(first):
    """Both ways of running the routed experts give the same outputs, rows picking another shard's experts (ids
    outside first .. first + E - 1) included: a large pass (grouped) against its rows in small passes (dense)."""
    experts, d, f, picks, rows = 6, 16, 8, 3, DENSE_EXPERT_ROWS + 40
    keys = jax.random.split(jax.random.key(first), 6)
    x = jax.random.normal(keys[0], (rows, d))
    weights = jax.random.uniform(keys[1], (rows, picks))
    ids = jax.random.randint(keys[2], (rows, picks), 0, experts + 4)  # global ids; this shard holds first .. first+5
    gate, up = (jax.random.normal(k, (experts, d, f)) / 4 for k in keys[3:5])
    down = jax.random.normal(keys[5], (experts, f, d)) / 3
    grouped = routed_experts(x, weights, ids, gate, up, down, first)
    halves = [routed_experts(x[s], weights[s], ids[s], gate, up, down, first) for s in np.split(np.arange(rows), 2)]
    chex.assert_trees_all_close(jnp.concatenate(halves), grouped, **TOL)
    assert float(jnp.abs(grouped).max()) > 0.1
