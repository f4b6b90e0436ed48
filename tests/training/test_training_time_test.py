"""Training-time test: the head's deeper steps in training see what a decode round's drafts see (the MTP layer's
states over the true hiddens up to the chain's start, and the chain's own earlier drafts), checked against the
decode loop's own way of drafting: the MTP layer's cache extended over the true hiddens, then single-token steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.models.kv_cache import KVCache
from mtp_jax.training.head_training import step_logits, ttt_mask
from tests.support.tiny_models import tiny_config

WIDTH, STEPS = 10, 3


def test_each_draft_sees_the_true_context_up_to_its_chain_and_its_chain():
    mask = ttt_mask(3, 4)
    entry = lambda depth, slot: (depth - 1) * 4 + slot
    assert mask[entry(1, 2)].tolist() == [True, True, True, False] + [False] * 8  # depth 1: causal over the truth
    # depth 3 at slot 3 (chain started at slot 1): the truth up to slot 1, depth 2 at slot 2, itself
    seen = {(d, s) for d in (1, 2, 3) for s in range(4) if mask[entry(3, 3), entry(d, s)]}
    assert seen == {(1, 0), (1, 1), (2, 2), (3, 3)}
    assert mask.diagonal().all()  # every entry sees at least itself


@pytest.mark.parametrize("layout", ["deepseek", "mimo"])
def test_training_time_test_drafts_as_the_decode_loop_does(layout):
    model = mtp_jax.CausalLM(tiny_config(layout, vocab=32), rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.key(1), (2, WIDTH), 4, 32)
    positions = jnp.broadcast_to(jnp.arange(WIDTH), tokens.shape)
    cache = (KVCache.zeros(model.config.num_layers, 2, 1, model.config, model.dtype),)
    hidden, _ = model.trunk(tokens, positions, cache)
    trained = step_logits(model, tokens, hidden, STEPS, training_time_test=True)
    untested = step_logits(model, tokens, hidden, STEPS)
    np.testing.assert_allclose(trained[0], untested[0], atol=1e-5)  # depth 1 is the same either way
    gap = []
    for start in (0, 3, WIDTH - STEPS - 1):
        # the loop: the MTP cache over the true hiddens at slots 0..start, then a draft step a depth
        mtp_cache = model.new_mtp_cache(2, WIDTH + STEPS)
        recurse, normed, mtp_cache = model.mtp_step(hidden[:, : start + 1], tokens[:, 1 : start + 2],
                                                    positions[:, : start + 1], mtp_cache)  # fmt: skip
        h = recurse[:, -1:]
        for depth in range(2, STEPS + 1):
            slot = start + depth - 1
            h, normed, mtp_cache = model.mtp_step(h, tokens[:, slot + 1 : slot + 2], positions[:, slot : slot + 1],
                                                  mtp_cache)  # fmt: skip
            drafted = model.draft_logits(normed)[:, 0]
            np.testing.assert_allclose(trained[depth - 1][:, slot], drafted, rtol=1e-4, atol=1e-4)
            gap.append(float(jnp.max(jnp.abs(untested[depth - 1][:, slot] - drafted))))
    assert max(gap) > 1e-3  # without it, the deeper steps see other chains' recursed states


@pytest.mark.slow
def test_train_head_reads_answer_shards_and_trains_with_training_time_test(tmp_path):
    """`train_head --data FOLDER --training-time-test` on shards `distill --shards` wrote: it runs, writes a head,
    and records the setting."""
    import json

    from mtp_jax.cli.train_head import main as train_main
    from mtp_jax.conversion.export import save_hf_folder
    from mtp_jax.loading.heads import trunk_fingerprint
    from mtp_jax.training import answer_shards

    trunk = mtp_jax.CausalLM(tiny_config("deepseek", vocab=32), rngs=nnx.Rngs(0))
    folder = tmp_path / "trunk"
    save_hf_folder(trunk, str(folder))
    rng = np.random.default_rng(0)
    records = [{"token_ids": rng.integers(4, 32, 20).tolist(), "prompt_len": 4, "category": "chat"} for _ in range(6)]
    run = answer_shards.ShardRun("train", 0, 0.0, 16)
    answer_shards.write(str(tmp_path / "shards"), run, 0, 6, records, trunk_fingerprint(trunk.config))
    out = tmp_path / "head"
    code = train_main(["--model", str(folder), "--data", str(tmp_path / "shards"), "--steps", "3", "--out", str(out),
                       "--batch-size", "2", "--seq-len", "20", "--training-time-test",
                       "--eval-every", "3"])  # fmt: skip
    assert code == 0 and (out / "head.safetensors").exists()
    assert json.loads((out / "training_report.json").read_text())["args"]["training_time_test"] is True
