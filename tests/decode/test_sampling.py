"""Sampling settings and random streams are per row: reproducible, independent, and never leaking across rows."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.decode.sampling import SamplingParams, probabilities
from tests.support.tiny_models import tiny_config

PROMPTS = np.array([[5, 6, 7, 8], [9, 10, 11, 12], [5, 6, 7, 8], [13, 14, 15, 16]], np.int32)
LENS = np.array([4, 2, 4, 3], np.int32)
CFG = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=12, stop_on_eos=False)


@pytest.fixture(scope="module")
def model():
    return mtp_jax.CausalLM(tiny_config(vocab=40, eos=(2,)), rngs=nnx.Rngs(7))


def params(temperature, top_k, top_p) -> SamplingParams:
    return SamplingParams(temperature=jnp.asarray(temperature, jnp.float32), top_k=jnp.asarray(top_k, jnp.int32),
                          top_p=jnp.asarray(top_p, jnp.float32))  # fmt: skip


def test_probabilities_with_and_without_truncation():
    """Temperature-only rows are softmax(logits / T), whether or not another row of the batch truncates (the sort
    then runs for the whole batch); a top-k row keeps its k largest; greedy rows are one-hot."""
    logits = jax.random.normal(jax.random.key(0), (3, 2, 50)) * 3.0  # [B, T, V]
    expected = np.asarray(jax.nn.softmax(logits / 0.8, axis=-1))
    untruncated = probabilities(logits, params([0.8, 0.8, 0.0], [0, 0, 0], [1.0, 1.0, 1.0]))
    np.testing.assert_allclose(np.asarray(untruncated[:2]), expected[:2], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(untruncated[2]), np.asarray(jax.nn.one_hot(logits[2].argmax(-1), 50)))
    mixed = np.asarray(probabilities(logits, params([0.8, 0.8, 0.0], [0, 5, 0], [1.0, 1.0, 1.0])))
    np.testing.assert_allclose(mixed[0], expected[0], rtol=1e-5, atol=1e-7)
    top5 = np.argsort(-np.asarray(logits[1]), axis=-1)[:, :5]
    assert ((mixed[1] > 0).sum(-1) == 5).all() and (np.take_along_axis(mixed[1], top5, -1) > 0).all()
    np.testing.assert_allclose(mixed[1].sum(-1), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_rows_keep_their_own_settings_and_streams(model):
    keys = jax.random.split(jax.random.key(1), 4)
    mixed = params([1.0, 0.0, 1.0, 0.8], [0, 0, 0, 5], [1.0, 1.0, 1.0, 0.9])
    out = np.asarray(mtp_jax.generate(model, PROMPTS, LENS, keys, CFG, mixed).tokens)
    again = np.asarray(mtp_jax.generate(model, PROMPTS, LENS, keys, CFG, mixed).tokens)
    np.testing.assert_array_equal(out, again)  # same keys, same inputs: same output
    assert not np.array_equal(out[0], out[2])  # the same prompt and settings, two streams: two samples

    greedy = mtp_jax.generate(model, PROMPTS, LENS, keys, mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=12,
                                                                               stop_on_eos=False))  # fmt: skip
    np.testing.assert_array_equal(out[1], np.asarray(greedy.tokens)[1])  # the greedy row in a sampled batch

    # Each row again with everything around it changed (other rows greedy, other keys): its tokens do not move.
    for row in (0, 3):
        others = [r for r in range(4) if r != row]
        other_keys = keys.at[np.array(others)].set(jax.random.split(jax.random.key(99), 3))
        settings = params(
            [mixed.temperature[r] if r == row else 0.0 for r in range(4)],
            [mixed.top_k[r] if r == row else 3 for r in range(4)],
            [mixed.top_p[r] if r == row else 0.5 for r in range(4)],
        )
        alone = np.asarray(mtp_jax.generate(model, PROMPTS, LENS, other_keys, CFG, settings).tokens)
        np.testing.assert_array_equal(alone[row], out[row], err_msg=f"row {row}")


@pytest.mark.slow
def test_temperature_zero_through_the_sampling_path_is_greedy(model):
    """Per-row arrays with every temperature 0 run the rejection-sampling code: it reduces to greedy exactly."""
    keys = jax.random.split(jax.random.key(2), 4)
    sampled_path = mtp_jax.generate(model, PROMPTS, LENS, keys, CFG, params([0.0] * 4, [0] * 4, [1.0] * 4))
    greedy_path = mtp_jax.generate(model, PROMPTS, LENS, keys, CFG)
    np.testing.assert_array_equal(np.asarray(sampled_path.tokens), np.asarray(greedy_path.tokens))
    np.testing.assert_array_equal(np.asarray(sampled_path.stats.accepted_at), np.asarray(greedy_path.stats.accepted_at))


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "hf"
    cfg = tiny_config(vocab=40, eos=(2,)).replace(max_position_embeddings=64)
    save_hf_folder(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(7)), folder)
    return folder


def run_decode(capsys, tmp_path, folder, lines: list[dict], *extra) -> list[list[int]]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = ["--model", folder, "--prompts-file", prompts, "--out", out, "--max-new-tokens", 10, "--batch-size", 2,
            "--dtype", "float32", "--num-draft", 2, *extra]  # fmt: skip
    code = decode_main([str(a) for a in argv])
    assert code == 0, capsys.readouterr().err
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_cli_per_row_settings_and_seeds(checkpoint_folder, capsys, tmp_path):
    lines = [
        {"token_ids": [5, 6, 7], "temperature": 0},
        {"token_ids": [5, 6, 7]},
        {"token_ids": [5, 6, 7], "seed": 123},
        {"token_ids": [5, 6, 7], "top_k": 1},  # top-1 sampling is greedy
    ]
    first = run_decode(capsys, tmp_path, checkpoint_folder, lines, "--temperature", 1.0, "--seed", 0)
    again = run_decode(capsys, tmp_path, checkpoint_folder, lines, "--temperature", 1.0, "--seed", 0)
    other_seed = run_decode(capsys, tmp_path, checkpoint_folder, lines, "--temperature", 1.0, "--seed", 1)
    greedy = run_decode(capsys, tmp_path, checkpoint_folder, lines[:1], "--no-mtp")
    assert first == again
    assert first[0] == greedy[0] == first[3]
    assert first[1] != other_seed[1]  # its stream follows --seed
    assert first[2] == other_seed[2]  # its own seed: --seed does not touch it
    assert first[1] != first[2]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"token_ids": [5], "temperature": -0.5}, "temperature must be >= 0"),
        ({"token_ids": [5], "top_p": 0}, "top_p must be in (0, 1]"),
        ({"token_ids": [5], "top_k": 1.5}, "top_k must be an integer >= 0"),
        ({"token_ids": [5], "seed": "x"}, "seed must be an integer"),
    ],
)
def test_cli_bad_row_setting_is_one_line(checkpoint_folder, capsys, tmp_path, line, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(line) + "\n")
    assert decode_main(["--model", str(checkpoint_folder), "--prompts-file", str(prompts)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "p.jsonl:1" in err, err
