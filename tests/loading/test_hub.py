"""`--model ORG/NAME[@REVISION]` / `load_model("ORG/NAME")`: resolved through huggingface_hub's cache, offline.

The cache is built by hand in the layout huggingface_hub reads (HF_HOME/hub/models--ORG--NAME/{refs/main,
snapshots/<commit>/<file> -> ../../blobs/<sha256>}), holding a tiny model written by `save_hf_folder`.
huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, when imported: the in-process tests set its constants as it
would have read them from that environment; the CLI tests run in a fresh process with the environment alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

import mtp_jax
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.cli.plan import model_config
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.loading.hub import NEEDED_FILES, SUBFOLDERS, local_path, names_a_model
from mtp_jax.runtime.errors import ConversionError, UserError
from tests.support.commands import ROOT
from tests.support.tiny_models import tiny_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = [[5, 6, 7, 8], [11, 12], [20, 21, 22]]


def tiny_model():
    cfg = tiny_config("deepseek", vocab=40, eos=(2,)).replace(family="qwen2", qkv_bias=True, max_position_embeddings=64)
    return mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(7))


def cache_repo(hf_home, repo: str, files_folder) -> str:
    """Put the files of `files_folder` into the hub cache under HF_HOME as revision main = COMMIT; the snapshot."""
    storage = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(files_folder)):
        data = (files_folder / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (storage / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    return str(snapshot)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(HF_HOME, the snapshot folder of org/tiny, the model written there, a prompts file)."""
    root = tmp_path_factory.mktemp("hub")
    model = tiny_model()
    save_hf_folder(model, root / "written")
    snapshot = cache_repo(root / "hf_home", "org/tiny", root / "written")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))
    return root / "hf_home", snapshot, model, prompts


@pytest.fixture
def offline(hub_cache, monkeypatch):
    """HF_HOME at the test cache and HF_HUB_OFFLINE=1, as huggingface_hub reads them at import."""
    hf_home = hub_cache[0]
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def greedy_tokens(model) -> np.ndarray:
    ids = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)] = prompt
    lens = np.array([len(p) for p in PROMPTS], np.int32)
    out = mtp_jax.generate(model, ids, lens, jax.random.key(0), mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=8))
    return np.asarray(out.tokens)


@pytest.mark.slow
def test_a_repo_id_loads_the_model_written_into_the_cache(offline):
    _, _, written, _ = offline
    loaded = mtp_jax.load_model("org/tiny", dtype="float32")
    assert loaded.mtp is not None
    np.testing.assert_array_equal(greedy_tokens(loaded), greedy_tokens(written))


def test_repo_ids_revisions_and_local_paths(offline, tmp_path, monkeypatch):
    _, snapshot, _, _ = offline
    assert local_path("org/tiny") == snapshot
    assert local_path("org/tiny@main") == snapshot
    assert local_path(f"org/tiny@{COMMIT}") == snapshot
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert local_path("org/tiny") == "org/tiny"  # an existing local path wins
    for text in ("nope", "a/b/c", "org/model.gguf", "./org/x", str(tmp_path / "nope"), "org/bad--name"):
        assert local_path(text) == text and not names_a_model(text), text
    assert names_a_model("org/tiny") and names_a_model("other/repo@v1")
    with pytest.raises(ConversionError, match="a/b/c: no such file or folder"):
        mtp_jax.load_model("a/b/c")


def test_only_the_files_a_load_reads_are_fetched():
    """The patterns as huggingface_hub's snapshot_download applies them to a repo's file list."""
    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "README.md", ".gitattributes", "pytorch_model.bin", "original/consolidated.safetensors", "onnx/model.onnx",
            "original/tokenizer.model"]  # fmt: skip
    fetched = list(filter_repo_objects(repo, allow_patterns=NEEDED_FILES, ignore_patterns=SUBFOLDERS))
    assert sorted(fetched) == sorted(repo[:8])


def test_plan_reads_a_repo_ids_config(offline):
    cfg, name = model_config(argparse.Namespace(random_shape=None, model="org/tiny@main", draft_vocab=None))
    written = offline[2].config
    assert name == "tiny@main"
    assert (
        (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers)
        == ("qwen2", 40, 32, 2)
        == (written.family, written.vocab_size, written.hidden_size, written.num_layers)
    )


@pytest.mark.parametrize("ref", ["org/absent", "org/tiny@v9"])
def test_a_repo_not_cached_offline_is_one_line(offline, capsys, ref):
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        local_path(ref)
    code = decode_main(["--model", ref, "--prompt", "hi"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.startswith(f"error: {ref}: Hugging Face repo {ref.split('@')[0]} ")
    assert "not (completely) in the hub cache" in captured.err and "offline" in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err


def run_decode(env: dict, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mtp_jax.decode", *map(str, args)]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_decode_cli_takes_a_repo_id_in_a_fresh_process(hub_cache, tmp_path, capsys):
    hf_home, snapshot, _, prompts = hub_cache
    common = ["--prompts-file", prompts, "--max-new-tokens", 8, "--dtype", "float32", "--num-draft", 2]
    assert decode_main(["--model", snapshot, *map(str, common), "--out", str(tmp_path / "local.jsonl")]) == 0
    capsys.readouterr()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    proc = run_decode(env, "--model", "org/tiny@main", *common, "--out", tmp_path / "hub.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[json.loads(line)["token_ids"] for line in (tmp_path / f).read_text().splitlines()]
            for f in ("local.jsonl", "hub.jsonl")]  # fmt: skip
    assert rows[0] == rows[1] and len(rows[0]) == len(PROMPTS)
    proc = run_decode(env, "--model", "org/absent", *common)
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "org/absent" in proc.stderr and "HF_HUB_OFFLINE is set" in proc.stderr
