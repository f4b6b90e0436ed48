"""`python -m mtp_jax.train_head` against mixed runs and bad data: a fresh run does not write over another run's
checkpoints, --resume continues only its own run, ids outside the vocabulary and diverged weights save nothing, and
a head is replaced whole."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import nnx

import mtp_jax
import mtp_jax.loading.heads
from mtp_jax.cli.train_head import main as train_main
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.loading.heads import attach_head, save_head
from mtp_jax.runtime.errors import UserError
from tests.support.tiny_models import predictable_model, tiny_config


def sequences(vocab: int, count: int = 8, length: int = 16, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"token_ids": rng.integers(0, vocab, length).tolist(), "prompt_len": 3} for _ in range(count)]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    """A tiny trunk folder and training data for it."""
    root = tmp_path_factory.mktemp("trunk")
    save_hf_folder(predictable_model("deepseek", seed=3), root / "hf")
    write_jsonl(root / "data.jsonl", sequences(tiny_config().vocab_size))
    return root


def train(capsys, trunk, out, *extra) -> tuple[int, str]:
    args = ["--model", trunk / "hf", "--data", trunk / "data.jsonl", "--out", out, "--batch-size", 4, "--seq-len", 16,
            "--eval-every", 2, "--dtype", "float32", *extra]  # fmt: skip
    code = train_main([str(a) for a in args])
    return code, capsys.readouterr().err


def steps_in(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder / "checkpoints") if n.isdigit())


@pytest.mark.slow
def test_a_fresh_run_over_another_runs_checkpoints_is_refused_or_overwrites_them(trunk, tmp_path, capsys):
    out = tmp_path / "head"
    assert train(capsys, trunk, out, "--steps", 4)[0] == 0
    assert steps_in(out) == ["2", "4"]
    head = (out / "head.safetensors").read_bytes()
    code, err = train(capsys, trunk, out, "--steps", 2, "--seed", 1)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "another run's checkpoint" in err and "--resume" in err and "--overwrite" in err
    assert (out / "head.safetensors").read_bytes() == head and steps_in(out) == ["2", "4"]
    code, err = train(capsys, trunk, out, "--steps", 2, "--seed", 1, "--overwrite")
    assert code == 0, err
    assert steps_in(out) == ["2"]  # the first run's step 4 is gone: no mix of two runs
    assert (out / "head.safetensors").read_bytes() != head


@pytest.mark.slow
def test_resume_continues_only_a_run_of_the_same_settings_and_data(trunk, tmp_path, capsys):
    out = tmp_path / "head"
    assert train(capsys, trunk, out, "--steps", 2)[0] == 0
    code, err = train(capsys, trunk, out, "--steps", 4, "--resume", "--lr", 1e-3)
    assert code == 1 and "lr 0.002 (now 0.001)" in err and len(err.strip().splitlines()) == 1, err
    other = tmp_path / "other.jsonl"
    write_jsonl(other, sequences(tiny_config().vocab_size, seed=1))
    code, err = train(capsys, trunk, out, "--steps", 4, "--resume", "--data", other)
    assert code == 1 and "differs in data_sha256" in err, err
    assert steps_in(out) == ["2"]
    code, err = train(capsys, trunk, out, "--steps", 4, "--resume")
    assert code == 0 and "resumed from step 2" in err, err


@pytest.mark.parametrize("bad_id", [300, -2])
def test_token_ids_outside_the_vocabulary_are_refused(trunk, tmp_path, capsys, bad_id):
    records = sequences(tiny_config().vocab_size)
    records[1]["token_ids"][5] = bad_id
    data = write_jsonl(tmp_path / "bad.jsonl", records)
    code, err = train(capsys, trunk, tmp_path / "head", "--steps", 2, "--data", data)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"record 2: token id {bad_id} is outside the vocabulary [0, 24)" in err
    assert not (tmp_path / "head").exists()


def test_a_data_file_that_is_not_utf8_is_one_line(trunk, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"token_ids": [1, 2, 3]}\n{"prompt": "caf\xe9"}\n')
    code, err = train(capsys, trunk, tmp_path / "head", "--steps", 2, "--data", data)
    assert code == 1 and f"{data}:2: not a line of UTF-8 JSON" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_a_diverged_run_saves_no_head_and_no_checkpoint(trunk, tmp_path, capsys):
    out = tmp_path / "head"
    code, err = train(capsys, trunk, out, "--steps", 4, "--lr", 1e30, "--warmup", 0)
    last = err.strip().splitlines()[-1]  # after the progress bars
    assert code == 1 and last.startswith("error: training diverged by step 2 (loss nan): mtp/"), err
    assert not (out / "head.safetensors").exists() and steps_in(out) == []


def test_save_head_refuses_non_finite_weights(tmp_path):
    model = predictable_model("deepseek", seed=3)
    model.mtp.proj[...] = model.mtp.proj[...].at[0, 0].set(np.nan)
    with pytest.raises(UserError, match=r"non-finite weights: model\.layers\.2\.eh_proj\.weight"):
        save_head(model, str(tmp_path / "head"))
    assert not (tmp_path / "head" / "head.json").exists()


def test_save_head_replaces_a_head_whole_or_not_at_all(tmp_path, monkeypatch):
    trunk, folder = predictable_model("deepseek", seed=3), tmp_path / "head"
    save_head(trunk, str(folder))
    before = {name: (folder / name).read_bytes() for name in ("head.safetensors", "head.json")}
    (folder / ".head.safetensors.partial-dead").write_bytes(b"left by a killed save")

    def save_file_then_fail(tensors, path):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device", path)

    other = mtp_jax.CausalLM(trunk.config, rngs=nnx.Rngs(7))
    monkeypatch.setattr(mtp_jax.loading.heads, "save_file", save_file_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_head(other, str(folder))
    monkeypatch.undo()
    assert {name: (folder / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(folder)) == ["head.json", "head.safetensors"]  # the staged and the leftover file go
    attach_head(trunk, str(folder))
    save_head(other, str(folder))
    assert (folder / "head.safetensors").read_bytes() != before["head.safetensors"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda meta: meta.pop("trunk"), "head.json: trunk is missing"),
        (lambda meta: meta["mtp"].update(bogus=1), "head.json: not a head description"),
    ],
)
def test_a_bad_head_description_is_one_line(tmp_path, edit, message):
    trunk, folder = predictable_model("deepseek", seed=3), tmp_path / "head"
    save_head(trunk, str(folder))
    meta = json.loads((folder / "head.json").read_text())
    edit(meta)
    (folder / "head.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=message):
        attach_head(trunk, str(folder))
