"""MTP-head training: loss weights, target alignment of the recursion, learning, resume, one compile."""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import mtp_jax
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.cli.score import acceptance_counts, teacher_forced_predictions
from mtp_jax.cli.train_head import main as train_main
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.models.kv_cache import KVCache
from mtp_jax.training.head_training import (
    Batch,
    TrainConfig,
    Trainer,
    frequent_tokens,
    init_head_from_trunk,
    loss_weights,
    step_logits,
    step_losses,
)
from mtp_jax.training.sequences import SequenceData
from tests.support.tiny_models import predictable_model, tiny_config


def test_loss_weights_match_the_formula():
    np.testing.assert_allclose(loss_weights(3), [1 / 1.96, 0.6 / 1.96, 0.36 / 1.96], rtol=1e-6)
    np.testing.assert_allclose(loss_weights(3), [0.51, 0.31, 0.18], atol=0.005)
    assert loss_weights(1).tolist() == [1.0]


def wire_head(model, select: str):
    """Make the MTP block an identity (no attention, no MLP) and its fusion pass one input through: the token
    embedding ("token") or the hidden ("hidden"). Then every slot's output depends on its own inputs only."""
    d = model.config.hidden_size
    eye, zero = jnp.eye(d), jnp.zeros((d, d))
    model.mtp.proj[...] = jnp.concatenate([eye, zero] if select == "token" else [zero, eye], axis=0)
    block = model.mtp.block.layers
    block.attn.o_proj[...] = jnp.zeros_like(block.attn.o_proj[...])
    block.mlp.down_proj[...] = jnp.zeros_like(block.mlp.down_proj[...])
    return model


def trunk_hidden_and_argmax(model, tokens):
    cache = (KVCache.zeros(model.config.num_layers, tokens.shape[0], 1, model.config, model.dtype),)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model.trunk(tokens, positions, cache)
    return hidden, np.asarray(jnp.argmax(model.logits(hidden), -1))


@pytest.mark.slow
def test_recursion_shifts_the_hidden_by_one_slot_per_step():
    """With the fusion passing the hidden straight through, step k at slot s reproduces the trunk's prediction
    from slot s-k+1 (the chain that started k-1 slots earlier). An off-by-one in the shift breaks this."""
    model = wire_head(predictable_model("deepseek", seed=2), "hidden")
    tokens = jnp.asarray([[5, 9, 13, 7, 8, 20, 4, 11, 6, 17]])
    hidden, trunk_argmax = trunk_hidden_and_argmax(model, tokens)
    for k, logits in enumerate(step_logits(model, tokens, hidden, 3)):
        predicted = np.asarray(jnp.argmax(logits, -1))[0]
        np.testing.assert_array_equal(predicted[k:], trunk_argmax[0, : 10 - k])


@pytest.mark.slow
def test_targets_are_two_tokens_ahead_and_counts_by_hand():
    """With the fusion passing the token x[s+1] through, every step predicts bigram(x[s+1]); on a sequence that
    follows the bigram map, every counted target x[s+2] is right. Counts: s >= step, s+2 < length,
    s+2 >= loss_start."""
    model = wire_head(predictable_model("deepseek", seed=2), "token")
    vocab = model.config.vocab_size
    embeds = model.embed_tokens(jnp.arange(vocab)[:, None])  # [V, 1, D]
    normed = model.mtp.final_norm(model.mtp.token_norm(embeds))
    bigram = np.asarray(jnp.argmax(model.logits(normed), -1))[:, 0]  # [V]: what the wired head predicts
    sequence = [11]
    for _ in range(11):
        sequence.append(int(bigram[sequence[-1]]))
    tokens = jnp.asarray([sequence])
    hidden, _ = trunk_hidden_and_argmax(model, tokens)
    batch = Batch(tokens=tokens, hidden=hidden, lengths=jnp.asarray([12]), loss_start=jnp.asarray([3]))
    _, accuracy, counts = step_losses(model, batch, 3, jnp.arange(vocab))
    np.testing.assert_array_equal(np.asarray(accuracy), [1.0, 1.0, 1.0])
    # s + 2 in [3, 12) and s >= step: step 0 -> s in [1, 9] (9), step 1 -> [1, 9] (9), step 2 -> [2, 9] (8)
    np.testing.assert_array_equal(np.asarray(counts), [9, 9, 8])
    # Tokens one and two slots apart differ, so a target one slot early or late (x[s+1], x[s+3]) would be wrong.
    assert all(a not in (b, c) for a, b, c in zip(sequence[2:], sequence[1:], sequence[3:], strict=False))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["kl", "tv"])
def test_distribution_objectives_match_the_trunk_one_slot_ahead(objective):
    """The "kl" loss of step k averages, over the slots it counts, KL(p_{s+1} || q_s), the "tv" loss
    1 - sum min(p_{s+1}, q_s): p the trunk's next-token distribution at slot s+1 (the one that chose x[s+2]) over the
    draft vocabulary, q the draft at slot s. Checked slot by slot in numpy on a random model with a draft-vocabulary
    subset; a teacher taken at slot s or s+2, or a target outside the subset dropped, would change the numbers."""
    cfg = tiny_config("deepseek", eos=())
    cfg = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, draft_vocab_size=cfg.vocab_size // 2))
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(3))
    vocab = cfg.vocab_size
    model.draft_vocab[...] = jnp.arange(0, vocab, 2, dtype=jnp.int32)  # even ids only
    tokens = jnp.asarray([[5, 9, 13, 7, 8, 20, 4, 11, 6, 17], [3, 1, 2, 9, 14, 0, 0, 0, 0, 0]])
    hidden, _ = trunk_hidden_and_argmax(model, tokens)
    batch = Batch(tokens=tokens, hidden=hidden, lengths=jnp.asarray([10, 5]), loss_start=jnp.asarray([2, 0]))
    losses, _, counts = step_losses(model, batch, 2, jnp.arange(vocab), objective=objective)
    trunk = np.asarray(model.logits(hidden))[..., ::2]  # [B, T, Vd]
    log_p = trunk - np.log(np.exp(trunk).sum(-1, keepdims=True))
    divergence = {
        "kl": lambda lp, lq: np.sum(np.exp(lp) * (lp - lq)),
        "tv": lambda lp, lq: 0.5 * np.sum(np.abs(np.exp(lp) - np.exp(lq))),
    }[objective]
    for step, logits in enumerate(step_logits(model, tokens, hidden, 2)):
        logits = np.asarray(logits)
        log_q = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        terms = [divergence(log_p[b, s + 1], log_q[b, s])
                 for b, (length, start) in enumerate([(10, 2), (5, 0)])
                 for s in range(step, length - 2) if s + 2 >= start]  # fmt: skip
        assert int(counts[step]) == len(terms)
        assert float(losses[step]) == pytest.approx(np.mean(terms), rel=1e-4)


def self_distilled_data(model, count=24, new_tokens=40, seed=0):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(4, model.config.vocab_size, size=(count, 3))
    cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=new_tokens, stop_on_eos=False)
    out = mtp_jax.generate(model, prompts, np.full(count, 3), jax.random.key(0), cfg)
    tokens = np.asarray(out.tokens)
    return [{"token_ids": p.tolist() + t.tolist(), "prompt_len": 3} for p, t in zip(prompts, tokens, strict=True)]


def teacher_forced_depth_acceptance(model, data, depth=2):
    predictions, trunk = teacher_forced_predictions(model, data.tokens, depth)
    counts = acceptance_counts(predictions, trunk, data.lengths)
    return [a / j for a, j in zip(counts["agreed"], counts["judged"], strict=True)]


def fresh_head_model(seed=0):
    """A random trunk with a random head: nothing predictable wired in."""
    return mtp_jax.CausalLM(tiny_config("deepseek", eos=()), rngs=nnx.Rngs(seed))


@pytest.mark.slow
def test_objective_learns_and_resume_continues_exactly(tmp_path):
    model = fresh_head_model(seed=5)
    data = SequenceData(model, self_distilled_data(model), width=48)
    before = teacher_forced_depth_acceptance(model, data)
    cfg = TrainConfig(num_steps=2, train_steps=60, batch_size=8, learning_rate=1e-2, warmup_steps=5)
    trainer = Trainer(model, cfg)
    losses = []
    for step in range(60):
        losses.append(float(trainer.train_step(data.batch(step, 8, 0))["loss"]))
        if step == 29:
            trainer.save(str(tmp_path / "ckpt"))
    after = teacher_forced_depth_acceptance(trainer.model(), data)
    assert after[0] > 0.75 and after[0] > before[0] + 0.5, (before, after)  # seen: 0.07 -> 0.83
    assert losses[-1] < 0.5 * losses[0]
    assert trainer._train_step._cache_size() == 1  # compiled once

    resumed = Trainer(fresh_head_model(seed=5), cfg)
    assert resumed.restore(str(tmp_path / "ckpt")) and resumed.step == 30
    for step in range(30, 34):
        loss = float(resumed.train_step(data.batch(step, 8, 0))["loss"])
        assert loss == pytest.approx(losses[step], rel=1e-5)


@pytest.mark.slow
def test_generate_runs_inside_the_training_loop():
    model = fresh_head_model(seed=6)
    init_head_from_trunk(model, jax.random.key(0))  # shares nothing with the trunk after init (donation-safe)
    data = SequenceData(model, self_distilled_data(model, count=8, new_tokens=10), width=16)
    trainer = Trainer(model, TrainConfig(num_steps=2, train_steps=4, batch_size=4))
    mtp_cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=6, stop_on_eos=False)
    plain_cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=6, stop_on_eos=False)
    prompts, lens = data.tokens[:2, :4], np.full(2, 4)

    @jax.jit
    def rollout(params, frozen):
        model = nnx.merge(trainer.graphdef, params, frozen)
        return mtp_jax.generate(model, prompts, lens, jax.random.key(1), mtp_cfg).tokens

    for step in range(2):
        trainer.train_step(data.batch(step, 4, 0))
        tokens = rollout(trainer.params, trainer.frozen)
        plain = mtp_jax.generate(trainer.model(), prompts, lens, jax.random.key(1), plain_cfg).tokens
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(plain))
    assert rollout._cache_size() == 1


def test_frequent_tokens_counts_responses_only():
    records = [{"token_ids": [9, 9, 9, 1, 2, 2], "prompt_len": 3}, {"token_ids": [3, 2, 5], "prompt_len": 1}]
    # responses: [1, 2, 2] and [2, 5] -> 2 three times; 1 and 5 once (tie: lower id); 9 and 3 are prompt-only
    np.testing.assert_array_equal(frequent_tokens(records, 10, 2), [1, 2])


@pytest.mark.slow
def test_train_head_cli_trains_resumes_and_writes_a_head_that_decodes(tmp_path, capsys):
    """`python -m mtp_jax.train_head` end to end on a tiny checkpoint: periodic eval in the report, `--resume`
    continuing from the last checkpoint, and a head folder that `decode --head` loads (greedy output as plain)."""
    trunk = predictable_model("deepseek", seed=3)
    folder, data = tmp_path / "trunk", tmp_path / "data.jsonl"
    save_hf_folder(trunk, folder)
    data.write_text("".join(json.dumps(r) + "\n" for r in self_distilled_data(trunk, count=8, new_tokens=12)))
    head = tmp_path / "head"
    argv = ["--model", folder, "--data", data, "--eval-data", data, "--out", head, "--eval-every", 2, "--batch-size",
            4, "--seq-len", 16, "--objective", "kl", "--draft-vocab", 12, "--dtype", "float32"]  # fmt: skip
    assert train_main([str(a) for a in [*argv, "--steps", 4]]) == 0, capsys.readouterr().err
    report = json.loads((head / "training_report.json").read_text())
    assert [entry["step"] for entry in report["log"]] == [2, 4]
    assert all(len(entry["eval"]["acceptance_per_depth"]) == 3 for entry in report["log"])
    capsys.readouterr()
    assert train_main([str(a) for a in [*argv, "--steps", 6, "--resume"]]) == 0
    assert "resumed from step 4" in capsys.readouterr().err
    assert [entry["step"] for entry in json.loads((head / "training_report.json").read_text())["log"]] == [6]

    prompts, outputs = tmp_path / "p.jsonl", {}
    prompts.write_text(json.dumps({"token_ids": [5, 6, 7]}) + "\n" + json.dumps({"token_ids": [9, 3]}) + "\n")
    for name, extra in [("plain", ["--no-mtp"]), ("mtp", ["--head", head, "--num-draft", 2])]:
        out = tmp_path / f"{name}.jsonl"
        argv = ["--model", folder, "--prompts-file", prompts, "--out", out, "--max-new-tokens", 12, "--dtype",
                "float32", *extra]  # fmt: skip
        assert decode_main([str(a) for a in argv]) == 0, capsys.readouterr().err
        outputs[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert outputs["mtp"] == outputs["plain"]

    # A second stage finetunes this head (--init existing --head): with a zero learning rate it comes out unchanged.
    stage_two = tmp_path / "head2"
    argv = ["--model", folder, "--data", data, "--out", stage_two, "--init", "existing", "--head", head, "--steps", 1,
            "--lr", 0, "--batch-size", 4, "--seq-len", 16, "--draft-vocab", 12, "--dtype", "float32"]  # fmt: skip
    assert train_main([str(a) for a in argv]) == 0, capsys.readouterr().err
    first, second = (safetensors.numpy.load_file(str(h / "head.safetensors")) for h in (head, stage_two))
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    assert train_main([str(a) for a in [*argv, "--init", "trunk-last"]]) == 1  # the last --init counts
    assert "--head goes with --init existing" in capsys.readouterr().err
    assert train_main([str(a) for a in [*argv, "--block-layers", 0]]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--block-layers must be >= 1")


@pytest.mark.parametrize("draft_vocab", [0, 12])
def test_a_new_head_replaces_a_trunk_head_with_another_draft_vocabulary(draft_vocab):
    """Training a new head for a model that already has one (the default model and its shipped head) starts from the
    trunk alone: the old head's draft vocabulary (8 ids here) does not leak into the new head's (12 ids, or none)."""
    from mtp_jax.cli.train_head import training_model

    cfg = tiny_config()
    trunk = mtp_jax.CausalLM(cfg.replace(mtp=dataclasses.replace(cfg.mtp, draft_vocab_size=8)), rngs=nnx.Rngs(0))
    records = self_distilled_data(predictable_model("deepseek", seed=3), count=4, new_tokens=10)
    args = argparse.Namespace(init="trunk-last", draft_vocab=draft_vocab, seed=0, block_layers=None, fused_layers=None)
    model = training_model(trunk, args, records)
    if draft_vocab:
        np.testing.assert_array_equal(model.draft_vocab[...], frequent_tokens(records, cfg.vocab_size, draft_vocab))
    else:
        assert model.draft_vocab is None
    np.testing.assert_array_equal(model.embed[...], trunk.embed[...])


@pytest.mark.parametrize("draft_vocab", [8, 12])
def test_finetuning_a_head_keeps_its_draft_vocabulary_of_the_same_size(draft_vocab):
    """--init existing on new data: the head's own 8-id subset stays (its rows were trained for it); another size is
    counted afresh from the data."""
    from mtp_jax.cli.train_head import training_model

    cfg = tiny_config()
    trunk = mtp_jax.CausalLM(cfg.replace(mtp=dataclasses.replace(cfg.mtp, draft_vocab_size=8)), rngs=nnx.Rngs(0))
    trunk.draft_vocab[...] = jnp.arange(8, 16, dtype=trunk.draft_vocab[...].dtype)
    records = self_distilled_data(predictable_model("deepseek", seed=3), count=4, new_tokens=10)
    args = argparse.Namespace(init="existing", draft_vocab=draft_vocab, seed=0, block_layers=None, fused_layers=None)
    model = training_model(trunk, args, records)
    expected = np.arange(8, 16) if draft_vocab == 8 else frequent_tokens(records, cfg.vocab_size, draft_vocab)
    np.testing.assert_array_equal(model.draft_vocab[...], expected)
    assert not np.array_equal(frequent_tokens(records, cfg.vocab_size, 8), np.arange(8, 16))  # the case is telling


@pytest.mark.parametrize("init", ["existing", "trunk-last"])
def test_a_trunk_holding_its_draft_table_trains_a_head_that_drafts_from_the_trunks_rows(init):
    """The default model loaded on a CPU holds its draft vocabulary's rows as a table of their own
    (`CausalLM.hold_draft_table`). That table is not copied into the model to train (it belongs to the old head's
    vocabulary and is not a parameter): the new head's drafts read the trunk's rows of its own vocabulary."""
    from mtp_jax.cli.train_head import training_model

    cfg = tiny_config()
    trunk = mtp_jax.CausalLM(cfg.replace(mtp=dataclasses.replace(cfg.mtp, draft_vocab_size=8)), rngs=nnx.Rngs(0))
    trunk.hold_draft_table(trunk.draft_head())
    records = self_distilled_data(predictable_model("deepseek", seed=3), count=4, new_tokens=10)
    args = argparse.Namespace(init=init, draft_vocab=12, seed=0, block_layers=None, fused_layers=None)
    model = training_model(trunk, args, records)
    assert model.draft_table is None
    hidden = jax.random.normal(jax.random.key(1), (3, cfg.hidden_size))
    whole = np.asarray(model.logits(hidden))[:, np.asarray(model.draft_vocab[...])]
    np.testing.assert_allclose(np.asarray(model.draft_logits(hidden)), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_grown_head_drafts_as_the_head_it_grew_from_then_trains_its_added_layer(tmp_path):
    """--init existing --block-layers 2 on a one-layer head: the added layer starts as an identity (the same logits
    at every step, exactly), training moves it, and it is saved under `block_layers.1.` and attached again."""
    from mtp_jax.cli.train_head import training_model
    from mtp_jax.loading.heads import attach_head, save_head
    from mtp_jax.runtime.errors import UserError

    trunk = predictable_model("deepseek", seed=3)
    records = self_distilled_data(trunk, count=8, new_tokens=12)
    grown = training_model(
        trunk, argparse.Namespace(init="existing", draft_vocab=0, seed=0, block_layers=2, fused_layers=None), records
    )
    assert grown.config.mtp.block_layers == 2
    data = SequenceData(grown, records, width=16)
    tokens, hidden = jnp.asarray(data.tokens), jnp.asarray(data.hidden)
    for before, after in zip(step_logits(trunk, tokens, hidden, 3), step_logits(grown, tokens, hidden, 3), strict=True):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))

    trainer = Trainer(grown, TrainConfig(num_steps=2, train_steps=3, batch_size=4, objective="tv", learning_rate=1e-2))
    for step in range(3):
        trainer.train_step(data.batch(step, 4, 0))
    added = trainer.model().mtp.block.layers
    assert np.abs(np.asarray(added.attn.o_proj[...][1])).max() > 0
    assert np.abs(np.asarray(added.mlp.down_proj[...][1])).max() > 0

    save_head(trainer.model(), str(tmp_path / "head"))
    names = safetensors.numpy.load_file(str(tmp_path / "head" / "head.safetensors")).keys()
    assert "model.layers.2.block_layers.1.self_attn.o_proj.weight" in names
    attached = attach_head(trunk, str(tmp_path / "head"))
    assert attached.config.mtp.block_layers == 2
    trained = [np.asarray(x) for x in step_logits(trainer.model(), tokens, hidden, 2)]
    reloaded = [np.asarray(x) for x in step_logits(attached, tokens, hidden, 2)]
    for a, b in zip(trained, reloaded, strict=True):
        np.testing.assert_allclose(b, a, atol=0.05)  # the file holds bfloat16
    with pytest.raises(UserError, match="grow, not shrink"):
        training_model(
            attached,
            argparse.Namespace(init="existing", draft_vocab=0, seed=0, block_layers=1, fused_layers=None),
            records,
        )
    with pytest.raises(UserError, match="last run of layers"):  # the tiny trunk has 2 layers to start from
        training_model(
            trunk,
            argparse.Namespace(init="existing", draft_vocab=0, seed=0, block_layers=3, fused_layers=None),
            records,
        )


def test_hiddens_kept_on_disk_are_read_back_for_the_same_trunk_and_data(tmp_path, monkeypatch):
    """--hiddens-cache: the trunk's hiddens (and a fused head's taps) are written once, read back by a run over the
    same data and trunk even with another head, and computed afresh for another trunk or other data."""
    from mtp_jax.training import sequences

    base = predictable_model("deepseek", seed=3)
    cfg = base.config.replace(mtp=dataclasses.replace(base.config.mtp, fused_layers=(0,)))
    model = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(base, nnx.Not(nnx.PathContains("mtp"))))
    records = self_distilled_data(base, count=5, new_tokens=10)
    computed = SequenceData(model, records, width=16)
    kept = SequenceData(model, records, width=16, cache_dir=str(tmp_path))
    assert len(list(tmp_path.iterdir())) == 1  # one folder, nothing partial left
    for data in (kept, SequenceData(model, records, width=16, cache_dir=str(tmp_path))):
        np.testing.assert_array_equal(np.asarray(data.hidden), computed.hidden)
        np.testing.assert_array_equal(np.asarray(data.taps), computed.taps)

    def no_trunk_pass(*args, **kwargs):
        raise AssertionError("the trunk ran")

    monkeypatch.setattr(sequences, "_trunk_hidden", no_trunk_pass)
    another_head = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(1))
    nnx.update(another_head, nnx.state(model, nnx.Not(nnx.PathContains("mtp"))))
    SequenceData(another_head, records, width=16, cache_dir=str(tmp_path))
    other_trunk = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(2))
    for trunk, data in ((other_trunk, records), (model, records[:4])):
        with pytest.raises(AssertionError, match="the trunk ran"):
            SequenceData(trunk, data, width=16, cache_dir=str(tmp_path))
