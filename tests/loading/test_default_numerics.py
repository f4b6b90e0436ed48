"""The default model as a CPU loads it by default: its GGUF's Q4_1 / Q8_0 blocks kept, the MTP layer held in Q8_0
blocks beside them, activations rounded to int8 where the row kernel sums integer products in vectors; greedy MTP
equal to plain decoding under those numerics."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax.decode.prompts import encode_prompts, pad_batch
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.loading import checkpoint
from mtp_jax.quant.int8_activations import has_int8_activations
from mtp_jax.quant.quantized_array import QuantizedArray

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("optimized_compiles")]  # conftest.py


def mtp_weights(model) -> dict:
    from flax import nnx

    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, p)): v.get_value() for p, v in state if "mtp" in p and str(p[-1]).endswith("proj")}


def test_default_numerics_follow_the_kernel_and_the_head_is_held_in_blocks(smollm2_path, monkeypatch):
    model, tokenizer = checkpoint.load(None)  # what the README command loads: the GGUF and the shipped head
    dot = cpu_rows.integer_dot()
    assert has_int8_activations(model) == (dot not in (None, "none"))
    weights = mtp_weights(model)
    assert weights and all(isinstance(w, QuantizedArray) and w.values.dtype == np.int8 for w in weights.values())
    for name, w in weights.items():  # Q8_0: a float16 scale per 32 contracting elements
        assert w.scales.dtype == np.float16 and w.values.size // w.scales.size == 32, name
    monkeypatch.setattr(cpu_rows, "integer_dot", lambda: "none")
    assert not has_int8_activations(checkpoint.load(None)[0])  # no integer dot: float rows
    assert has_int8_activations(checkpoint.load(None, activations="int8")[0])

    prompts = encode_prompts(["Why is the sky blue?", "Write a Python function that adds two numbers."], tokenizer,
                             chat=True, vocab_size=model.config.vocab_size, context=2048)  # fmt: skip
    ids, lens = pad_batch(prompts, 2, max(len(p.token_ids) for p in prompts))
    run = lambda k: mtp_jax.generate(model, ids, lens, jax.random.key(0), mtp_jax.DecodeConfig(num_draft=k,
                                     max_new_tokens=40))  # fmt: skip
    plain, drafted = run(0), run(3)
    np.testing.assert_array_equal(drafted.tokens, plain.tokens)
    np.testing.assert_array_equal(drafted.lengths, plain.lengths)
    assert float(drafted.stats.accepted) > 0


def test_a_head_to_train_stays_in_floats_beside_the_trunks_blocks(smollm2_path):
    """train_head's trunk: the GGUF's blocks kept (its hiddens are the decode's), the head as saved, in floats (a
    head in int8 blocks has no gradient)."""
    model, _ = checkpoint.load(None, float_head=True)
    weights = mtp_weights(model)
    assert weights and not any(isinstance(w, QuantizedArray) for w in weights.values())
    assert isinstance(model.segments[0].layers.attn.q_proj.get_value(), QuantizedArray)
