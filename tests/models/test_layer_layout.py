"""Unstacked layers (`mtp_jax.unstack_layers`, the GPU default): each layer holds arrays of its own and the layers run
one by one instead of a scan over stacked parameters. The model is the same one: the trunk's hidden states agree with
the stacked model's, and greedy MTP decoding (mixed prompt lengths, EOS mid-batch) gives the same tokens, lengths and
acceptance, for a GQA trunk, latent attention with routed experts, and a hybrid
(gated DeltaNet + gated attention) trunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.models.causal_lm import LayerStack, apply_layer_layout
from mtp_jax.quant import formats
from tests.support.decode_models import MODELS, PROMPT_LENS, decode, prompts_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unstacked_layers_decode_as_stacked(name):
    stacked = MODELS[name]()
    unstacked = mtp_jax.unstack_layers(MODELS[name]())
    params = nnx.state(unstacked, nnx.Param)
    stacks = [m for _, m in nnx.iter_graph(stacked) if isinstance(m, LayerStack)]
    assert stacks and all(
        isinstance(m.layers, nnx.List) for _, m in nnx.iter_graph(unstacked) if isinstance(m, LayerStack)
    )
    assert len(jax.tree.leaves(params)) > len(jax.tree.leaves(nnx.state(stacked, nnx.Param)))  # one array per layer

    prompts = prompts_for(stacked)
    positions = jnp.broadcast_to(jnp.arange(prompts.shape[1]), prompts.shape)
    hidden = [
        m.trunk(jnp.asarray(prompts), positions, m.new_cache(len(prompts), 32), jnp.asarray(PROMPT_LENS))[0]
        for m in (stacked, unstacked)
    ]
    np.testing.assert_allclose(hidden[1], hidden[0], rtol=1e-5, atol=1e-5)

    if name == "gqa":  # one scanned stack: its decode path is the MLA and hybrid models' (which add experts, groups)
        return
    a, b = decode(stacked, prompts, 2), decode(unstacked, prompts, 2)  # drafts, verify blocks, rejections
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.lengths, a.lengths)
    np.testing.assert_array_equal(b.stats.accepted_at, a.stats.accepted_at)
    assert 0 < a.stats.accepted < a.stats.drafted  # drafts accepted and rejected: both verify outcomes ran


def test_layer_layout_choice():
    model = MODELS["gqa"]()
    assert apply_layer_layout(model, "stacked") is model and not isinstance(model.segments[0].layers, nnx.List)
    expected = jax.default_backend() == "gpu"
    assert isinstance(apply_layer_layout(MODELS["gqa"](), "auto").segments[0].layers, nnx.List) == expected
    assert isinstance(apply_layer_layout(model, "unstacked").segments[0].layers, nnx.List)
    with pytest.raises(ValueError, match="layer layout"):
        apply_layer_layout(model, "rolled")
    # on TPU: stacked, unless the weights are quantized (their dequantization does not fuse with the layer slice)
    assert not isinstance(apply_layer_layout(MODELS["gqa"](), "auto", "tpu").segments[0].layers, nnx.List)
    int8 = formats.quantize_model(MODELS["gqa"](), "int8")
    assert isinstance(apply_layer_layout(int8, "auto", "tpu").segments[0].layers, nnx.List)
