"""A head with fused features (EAGLE-3: the outputs of some trunk layers join the final hidden in what the MTP layer
reads): the taps are the trunk's layer outputs as transformers computes them, a fusion that starts as the final
hidden drafts exactly as the head without it, greedy decoding with one equals plain decoding (chains, a tree, mixed
prompt lengths, EOS mid-batch), and it trains, saves, attaches and is refused where it cannot run."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM

import mtp_jax
from mtp_jax.cli.train_head import main as train_main
from mtp_jax.config.model import MtpConfig
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.families.registry import model_config_from_hf, tiny_configs
from mtp_jax.loading.heads import attach_head, save_head
from mtp_jax.training.acceptance import teacher_forced_predictions
from mtp_jax.training.head_training import Batch, TrainConfig, Trainer, init_head_from_trunk
from tests.support.parity_helpers import save_and_load, to_numpy
from tests.support.prompts import MIXED_LENS, MIXED_PROMPTS
from tests.support.tiny_models import predictable_model, tiny_config

FUSED = (0, 2)  # of 4 trunk layers
NEW_TOKENS = 40
SEED = 11  # with MIXED_PROMPTS: a row stops at EOS mid-batch and drafts are accepted at every depth


def fused_config(layers: tuple[int, ...] = FUSED, num_layers: int = 4):
    cfg = tiny_config().replace(num_layers=num_layers)
    return cfg.replace(mtp=dataclasses.replace(cfg.mtp, fused_layers=layers))


def with_fusion(model: mtp_jax.CausalLM, layers: tuple[int, ...] = FUSED, noise: float = 0.0) -> mtp_jax.CausalLM:
    """`model` with a head fusing `layers`: the same parameters, the fusion at [I; 0; ..] (plus `noise`)."""
    fused = mtp_jax.CausalLM(model.config.replace(mtp=dataclasses.replace(model.config.mtp, fused_layers=layers)),
                             rngs=nnx.Rngs(0))  # fmt: skip
    nnx.update(fused, nnx.state(model))
    d = model.config.hidden_size
    identity = jnp.eye((len(layers) + 1) * d, d)
    fused.mtp.feature_proj[...] = identity + noise * jax.random.normal(jax.random.key(1), identity.shape)
    return fused


def decode(model, k: int, tree: int = 0) -> mtp_jax.GenerateOutput:
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=NEW_TOKENS, tree=tree)
    return jax.tree.map(np.asarray, mtp_jax.generate(model, MIXED_PROMPTS, MIXED_LENS, jax.random.key(0), cfg))


@pytest.fixture(scope="module")
def models():
    """(the predictable model of 4 layers without fusion, the same with a fusion near [I; 0; 0], plain greedy)."""
    plain_model = predictable_model(seed=SEED, cfg=tiny_config().replace(num_layers=4))
    fused = with_fusion(plain_model, noise=0.05)
    return plain_model, fused, decode(plain_model, 0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_taps_are_the_layer_outputs_transformers_gives(tmp_path, layout):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model, _ = save_and_load(hf, tmp_path)
    if layout == "unstacked":
        model = mtp_jax.unstack_layers(model)
    ids = np.random.default_rng(0).integers(0, 64, (2, 9))
    positions = jnp.broadcast_to(jnp.arange(9), ids.shape)
    hidden, taps = model.trunk_taps(ids, positions, model.new_cache(2, 9), (0, 2))  # [B, T, D], [B, T, 2, D]
    with torch.no_grad():
        states = hf(torch.from_numpy(ids), output_hidden_states=True).hidden_states  # embeddings, then each layer
    np.testing.assert_allclose(taps[:, :, 0], to_numpy(states[1]), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(taps[:, :, 1], to_numpy(states[3]), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(hidden, to_numpy(states[-1]), atol=2e-5, rtol=2e-5)  # after the final norm


@pytest.mark.slow
def test_a_fusion_that_starts_as_the_final_hidden_drafts_as_the_head_without_it(models):
    plain_model, _, _ = models
    fused = with_fusion(plain_model)
    tokens = np.asarray(MIXED_PROMPTS)
    expected, trunk = teacher_forced_predictions(plain_model, tokens, 3)
    got, fused_trunk = teacher_forced_predictions(fused, tokens, 3)
    np.testing.assert_array_equal(fused_trunk, trunk)
    np.testing.assert_array_equal(got, expected)
    moved = with_fusion(plain_model, noise=0.5)  # a fusion that reads the taps drafts otherwise
    assert (teacher_forced_predictions(moved, tokens, 3)[0] != expected).any()


@pytest.mark.slow
@pytest.mark.parametrize("k, tree", [(1, 0), (3, 0), (3, 8)])
def test_greedy_with_fused_features_equals_plain(models, k, tree):
    _, fused, plain = models
    out = decode(fused, k, tree)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_array_equal(out.finished_by_eos, plain.finished_by_eos)
    stopped = plain.finished_by_eos & (plain.lengths < NEW_TOKENS)
    assert stopped.any() and not stopped.all(), plain.lengths
    assert out.stats.accepted > 0 and (out.stats.accepted_at > 0).all(), out.stats.accepted_at


def test_training_reaches_the_fusion_and_saved_heads_keep_it(models, tmp_path):
    plain_model, _, _ = models
    model = mtp_jax.CausalLM(fused_config(), rngs=nnx.Rngs(2))
    nnx.update(model, nnx.state(plain_model, nnx.Not(nnx.PathContains("mtp"))))
    init_head_from_trunk(model, jax.random.key(0))
    np.testing.assert_array_equal(model.mtp.feature_proj[...], np.eye(3 * 32, 32))
    tokens = jnp.asarray(MIXED_PROMPTS)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, taps = model.trunk_taps(tokens, positions, model.new_cache(*tokens.shape), FUSED)
    batch = Batch(tokens=tokens, hidden=hidden, lengths=jnp.asarray(MIXED_LENS), loss_start=jnp.zeros(4, jnp.int32),
                  taps=taps)  # fmt: skip
    trainer = Trainer(model, TrainConfig(num_steps=2, objective="kl", training_time_test=True, learning_rate=1e-2))
    losses = [float(trainer.train_step(batch)["loss"]) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    trained = trainer.model()
    assert not np.array_equal(trained.mtp.feature_proj[...], np.eye(3 * 32, 32))  # the taps' part moved too
    assert np.abs(np.asarray(trained.mtp.feature_proj[...])[32:]).max() > 0
    save_head(trained, str(tmp_path / "head"))
    assert json.loads((tmp_path / "head" / "head.json").read_text())["mtp"]["fused_layers"] == list(FUSED)
    bare = mtp_jax.CausalLM(tiny_config().replace(num_layers=4), rngs=nnx.Rngs(2))
    nnx.update(bare, nnx.state(trained, nnx.Not(nnx.PathContains("mtp"))))
    attached = attach_head(bare, str(tmp_path / "head"))
    assert attached.config.mtp.fused_layers == FUSED
    bf16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16))  # heads are saved in bfloat16
    np.testing.assert_array_equal(attached.mtp.feature_proj[...], bf16(trained.mtp.feature_proj[...]))
    np.testing.assert_array_equal(attached.mtp.feature_norm.scale[...], bf16(trained.mtp.feature_norm.scale[...]))


@pytest.mark.parametrize("layers, why", [((3,), "0..2"), ((2, 0), "increasing"), ((-1,), "0..2")])
def test_fused_layers_out_of_range_are_refused(layers, why):
    with pytest.raises(ValueError, match=why):
        fused_config(layers)


def test_a_hybrid_trunk_refuses_fused_layers():
    configs = (model_config_from_hf(config) for config in tiny_configs().values())
    hybrid = next(cfg for cfg in configs if cfg.is_hybrid and cfg.has_mtp)
    with pytest.raises(ValueError, match="recurrent"):
        hybrid.replace(mtp=MtpConfig(layout=hybrid.mtp.layout, fused_layers=(0,)))


@pytest.mark.slow
def test_train_head_adds_fused_layers_to_an_existing_head(tmp_path, capsys):
    trunk = predictable_model(seed=3, cfg=tiny_config().replace(num_layers=4))
    save_hf_folder(trunk, tmp_path / "hf")
    rng = np.random.default_rng(0)
    records = [{"token_ids": rng.integers(0, 24, 16).tolist(), "prompt_len": 3} for _ in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["--model", tmp_path / "hf", "--data", tmp_path / "data.jsonl", "--batch-size", 4, "--seq-len", 16,
            "--eval-every", 2, "--dtype", "float32", "--steps", 2, "--init", "existing"]  # fmt: skip
    run = lambda *extra: (train_main([str(a) for a in [*args, *extra]]), capsys.readouterr().err)
    for out, extra in (("head", ()), ("fused", ("--fused-layers", "0,2"))):  # no step moves either (--lr 0)
        code, err = run("--out", tmp_path / out, "--lr", 0, *extra)
        assert code == 0, err
    assert json.loads((tmp_path / "fused" / "head.json").read_text())["mtp"]["fused_layers"] == [0, 2]
    head, fused = (attach_head(trunk, str(tmp_path / out)) for out in ("head", "fused"))
    tokens = np.asarray(MIXED_PROMPTS)  # the grown head drafts as the head it grew from
    np.testing.assert_array_equal(teacher_forced_predictions(fused, tokens, 2)[0],
                                  teacher_forced_predictions(head, tokens, 2)[0])  # fmt: skip
    code, err = run("--out", tmp_path / "bad", "--fused-layers", "5")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "fused_layers [5]" in err, err


@pytest.mark.slow
def test_the_loop_drafts_from_the_fused_hidden(models):
    """The first drafts a k = 1 loop accepts, replayed from teacher-forced predictions over its own output: the loop's
    MTP layer reads the fusion of the taps (a fusion far from [I; 0; 0], so reading the final hidden would differ)."""
    plain_model, _, _ = models
    model = with_fusion(plain_model, noise=0.5)
    eos, total = set(model.config.eos_token_ids), 0
    for row, prompt_len in enumerate(MIXED_LENS):
        prompt = np.asarray(MIXED_PROMPTS)[row : row + 1, :prompt_len]
        cfg = mtp_jax.DecodeConfig(num_draft=1, max_new_tokens=NEW_TOKENS)
        out = mtp_jax.generate(model, prompt, np.asarray([prompt_len]), jax.random.key(0), cfg)
        tokens = np.concatenate([prompt[0], np.asarray(out.tokens)[0, : int(out.lengths[0])]])
        predictions, trunk = teacher_forced_predictions(model, tokens[None], 1)  # [1, T, 1], [1, T]
        hits, generated, slot = 0, 1, prompt_len - 1  # the first draft pairs h[P-1] with the first token
        done = tokens[prompt_len] in eos
        while not done:
            hit = predictions[0, slot, 0] == trunk[0, slot + 1]
            emitted = list(trunk[0, slot + 1 : slot + 3]) if hit else [trunk[0, slot + 1]]
            hits, slot = hits + int(hit), slot + len(emitted)
            kept = emitted[: next((i + 1 for i, t in enumerate(emitted) if t in eos), len(emitted))]
            kept = kept[: NEW_TOKENS - generated]
            generated += len(kept)
            done = generated >= NEW_TOKENS or any(t in eos for t in kept)
        assert int(out.stats.accepted) == hits, f"row {row}"
        total += hits
    assert total > 0
