"""The converter under kills and bad files: an overwritten DST is the old or the new model at every instant, killed
runs' leftovers go, folders get the umask's permissions, bad dtypes and config fields are one line."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import mtp_jax
from checkpoints_convert.__main__ import main as convert_main
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.config.model import RopeConfig
from mtp_jax.conversion import writer
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.params.converted import read_converted_config
from mtp_jax.plan import shapes
from tests.support.commands import ROOT
from tests.support.tiny_models import tiny_config


def tiny_model(seed: int) -> mtp_jax.CausalLM:
    return mtp_jax.CausalLM(tiny_config("deepseek", vocab=64, eos=(1,)), rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two Hugging Face folders of the same shape, different weights: the old and the new model."""
    root = tmp_path_factory.mktemp("sources")
    for name, seed in (("old", 0), ("new", 1)):
        save_hf_folder(tiny_model(seed), root / name)
    return root


def flat(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def greedy_tokens(model) -> np.ndarray:
    ids, lens = jnp.array([[5, 6, 7, 8]], jnp.int32), jnp.array([4], jnp.int32)
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=8)
    return np.asarray(mtp_jax.generate(model, ids, lens, jax.random.key(0), cfg).tokens)


@pytest.fixture(scope="module")
def references(sources):
    """(params, greedy tokens) of the old and the new model, as a converted folder holds them (float32)."""
    out = {}
    for name in ("old", "new"):
        model = mtp_jax.load_model(str(sources / name), dtype=jnp.float32)
        out[name] = (flat(model), greedy_tokens(model))
    assert not np.array_equal(out["old"][1], out["new"][1])  # decoding tells them apart
    return out


def which_model(folder, references) -> str:
    """'old' or 'new': the model the converted `folder` loads and decodes as (fails for anything else)."""
    model = mtp_jax.load_model(str(folder), dtype=jnp.float32)
    params, tokens = flat(model), greedy_tokens(model)
    for name, (want_params, want_tokens) in references.items():
        if all(np.array_equal(a, b) for a, b in zip(params, want_params, strict=True)):
            np.testing.assert_array_equal(tokens, want_tokens)
            return name
    raise AssertionError(f"{folder} is neither the old nor the new model")


def convert_into(capsys, src, dst, *extra) -> tuple[int, str]:
    code = convert_main([str(src), str(dst), "--dtype", "float32", *map(str, extra)])
    return code, capsys.readouterr().err


class Frozen:
    """Wraps a module (`os`, `shutil`) so that each call of the named functions first copies the destination's parent
    folder: each copy is exactly what a kill at that instant leaves (a kill runs no cleanup; its locks go)."""

    def __init__(self, module, names: tuple[str, ...], freeze):
        self._module, self._names, self._freeze = module, names, freeze

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if name not in self._names:
            return value

        def step(*args, **kwargs):
            self._freeze(name)
            return value(*args, **kwargs)

        return step


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "rename-aside"])
def test_overwrite_killed_at_every_step_leaves_the_old_or_the_new_model(
    sources, references, tmp_path, capsys, monkeypatch, exchange
):
    work, frozen = tmp_path / "work", tmp_path / "frozen"
    work.mkdir()
    assert convert_into(capsys, sources / "old", work / "out")[0] == 0
    steps = []

    def freeze(what: str):
        shutil.copytree(work, frozen / str(len(steps)), symlinks=True)
        steps.append(what)

    monkeypatch.setattr(writer, "os", Frozen(os, ("mkdir", "rename", "unlink", "makedirs"), freeze))
    monkeypatch.setattr(writer, "shutil", Frozen(shutil, ("rmtree",), freeze))
    real_exchange = writer._exchange
    monkeypatch.setattr(writer, "_exchange", lambda a, b: freeze("exchange") or (exchange and real_exchange(a, b)))
    code, err = convert_into(capsys, sources / "new", work / "out", "--overwrite")
    monkeypatch.undo()
    assert code == 0, err
    assert ("exchange" in steps) and (("rename" in steps) != exchange), steps
    seen, missing = [], 0
    for n, what in enumerate(steps):
        snapshot = frozen / str(n)
        dst = snapshot / "out"
        if exchange or os.path.isdir(dst):  # rename-aside: between its two renames DST is missing ...
            seen.append(which_model(dst, references))
        else:
            missing += 1
        writer.remove_leftovers(str(dst))  # ... and the next conversion into DST puts the old one back
        assert sorted(os.listdir(snapshot)) == ["out"], (n, what)  # a later run removes every leftover
        seen.append(which_model(dst, references))
    assert which_model(work / "out", references) == "new" and sorted(os.listdir(work)) == ["out"]
    assert seen[0] == "old" and "new" in seen  # the sequence of kills covers both sides of the swap
    assert missing == (0 if exchange else 1)


CHILD = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, even if the runner ignores it
from mtp_jax.conversion import convert, writer
from checkpoints_convert.__main__ import main

def interrupt(*args, **kwargs):
    os.kill(os.getpid(), signal.{signal})
    raise AssertionError("not reached: the signal ends or interrupts the run first")

{target} = interrupt
sys.exit(main(sys.argv[1:]))
"""


def run_child(signal: str, target: str, *argv) -> subprocess.CompletedProcess:
    script = CHILD.format(signal=signal, target=target)
    return subprocess.run([sys.executable, "-c", script, *map(str, argv)], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.slow
def test_a_killed_conversion_leaves_dst_whole_and_the_next_run_removes_its_leftovers(
    sources, references, tmp_path, capsys
):
    dst = tmp_path / "out"
    assert convert_into(capsys, sources / "old", dst)[0] == 0
    # SIGKILL with the complete new folder written and locked, just before the swap: DST is still the old model.
    child = run_child("SIGKILL", "writer._exchange", sources / "new", dst, "--overwrite", "--dtype", "float32")
    assert child.returncode == -9, child.stderr
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".out.partial-")]
    assert len(leftovers) == 1 and which_model(dst, references) == "old"
    assert convert_into(capsys, sources / "new", dst, "--overwrite")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["out"] and which_model(dst, references) == "new"


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_leaves_nothing(sources, tmp_path):
    child = run_child("SIGINT", "convert.nest", sources / "new", tmp_path / "out", "--dtype", "float32")
    assert child.returncode == 130
    assert child.stderr.strip().splitlines()[-1].startswith("interrupted: ") and "Traceback" not in child.stderr
    assert os.listdir(tmp_path) == []


def test_a_running_conversion_keeps_its_partial_folder(sources, tmp_path, capsys):
    live = tmp_path / ".out.partial-0123abcd"
    live.mkdir()
    with open(live / writer.LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the conversion writing it holds it
        assert convert_into(capsys, sources / "new", tmp_path / "out")[0] == 0
        assert live.is_dir()
    assert convert_into(capsys, sources / "old", tmp_path / "out", "--overwrite")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_converted_folders_get_the_umask_permissions(sources, tmp_path, capsys, umask):
    previous = os.umask(umask)
    try:
        assert convert_into(capsys, sources / "new", tmp_path / "out")[0] == 0
    finally:
        os.umask(previous)
    for folder in (tmp_path / "out", tmp_path / "out" / "params"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~umask, folder
    assert stat.S_IMODE(os.stat(tmp_path / "out" / "mtp_jax_config.json").st_mode) == 0o666 & ~umask


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: (p / "notes").mkdir() or (p / "notes" / "keep.txt").write_text("mine"), "not a converted"),
        (lambda p: (p / "notes").write_text("mine"), "not a folder"),
    ],
)
def test_overwrite_refuses_what_is_not_a_converted_folder(sources, tmp_path, capsys, make, message):
    make(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, err = convert_into(capsys, sources / "new", tmp_path / "notes", "--overwrite")
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == before


def test_destination_under_a_file_is_refused_before_converting(sources, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, err = convert_into(capsys, sources / "new", tmp_path / "file" / "out")
    assert code == 1 and "is a file" in err and len(err.strip().splitlines()) == 1, err
    assert not any(line.startswith("family") for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_a_weight_of_integer_or_bool_dtype_is_refused_by_name(sources, tmp_path, capsys, dtype):
    shutil.copytree(sources / "new", tmp_path / "hf")
    path = str(tmp_path / "hf" / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.ones_like(tensors["model.layers.0.mlp.up_proj.weight"], dtype)
    save_file(tensors, path)
    code, err = convert_into(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "model.layers.0.mlp.up_proj.weight" in err and np.dtype(dtype).name in err
    assert sorted(os.listdir(tmp_path)) == ["hf"]


CONFIG_EDITS = {
    "missing": (lambda c: c.pop("hidden_size"), "config.json: hidden_size is missing"),
    "not_a_number": (lambda c: c.update(hidden_size="big"), "config.json: hidden_size must be a positive integer"),
    "zero_heads": (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a positive integer"),
    "bool_as_text": (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings must be true, false"),
    "bad_rope": (lambda c: c.update(rope_scaling={"rope_type": "llama3"}), "config.json: factor is missing"),
}


@pytest.mark.parametrize("kind", sorted(CONFIG_EDITS))
def test_bad_config_fields_are_one_line_naming_the_field(sources, tmp_path, capsys, kind):
    edit, message = CONFIG_EDITS[kind]
    shutil.copytree(sources / "new", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    edit(config)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code, err = convert_into(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    code = decode_main(["--model", str(tmp_path / "hf"), "--prompt", "hi"])  # the loader's path: the same line
    err = capsys.readouterr().err
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err


def test_bad_config_fields_name_the_config_file_itself(sources, tmp_path, capsys):
    shutil.copytree(sources / "new", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["text_config"] = {"hidden_size": "big"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    line = f"error: {tmp_path / 'hf' / 'config.json'}: text_config.hidden_size must be a positive integer, got 'big'"
    code, err = convert_into(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1 and err.strip() == line, err
    code = decode_main(["--model", str(tmp_path / "hf"), "--prompt", "hi"])  # the loader's path: the same line
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == line, err


INDEX = "model.safetensors.index.json"
SOURCE_EDITS = {
    "config not UTF-8": ("config.json", b'{"model_type": "caf\xe9"}', "config.json: not UTF-8 text (byte 0xe9"),
    "config not an object": ("config.json", b"[1]", "config.json: expected a JSON object, got list"),
    "index not JSON": (INDEX, b'{"weight_map": ', f"{INDEX}: invalid JSON"),
    "index not UTF-8": (INDEX, b'{"weight_map": {"\xff": "x"}}', f"{INDEX}: not UTF-8 text (byte 0xff"),
    "no weight_map": (INDEX, b'{"metadata": {}}', f"{INDEX}: weight_map is missing or not a"),
    "weight_map a list": (INDEX, b'{"weight_map": ["model.safetensors"]}', f"{INDEX}: weight_map is missing or not a"),
    "weight_map of numbers": (INDEX, b'{"weight_map": {"lm_head.weight": 3}}', f"{INDEX}: weight_map is missing"),
    "missing shard": (INDEX, b'{"weight_map": {"w": "gone.safetensors"}}', f"{INDEX}: names gone.safetensors, which"),
    "eos file not JSON": ("generation_config.json", b'{"eos_token_id": [1,', "generation_config.json: invalid JSON"),
}


@pytest.mark.parametrize("kind", sorted(SOURCE_EDITS))
def test_a_malformed_json_file_of_the_source_is_one_line_naming_it(sources, tmp_path, capsys, kind):
    name, content, message = SOURCE_EDITS[kind]
    shutil.copytree(sources / "new", tmp_path / "hf")
    if name == "generation_config.json":  # read for the EOS ids where config.json has none
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        del config["eos_token_id"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / name).write_bytes(content)
    code, err = convert_into(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1 and f"{tmp_path / 'hf'}/{message}" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    dst = tmp_path_factory.mktemp("converted") / "out"
    assert convert_main([str(sources / "new"), str(dst), "--dtype", "float32"]) == 0
    return dst


def set_field(path: str, value):
    """An edit of mtp_jax_config.json setting the field at dotted `path` (deleting it for `...`)."""

    def edit(config: dict):
        *parents, name = path.split(".")
        for parent in parents:
            config = config[parent]
        if value is ...:
            del config[name]
        else:
            config[name] = value

    return edit


CONVERTED_EDITS = {
    "not JSON": (b'{"family": ', "invalid JSON"),
    "not UTF-8": (b'{"family": "caf\xe9"}', "not UTF-8 text (byte 0xe9"),
    "not an object": (b"[]", "expected a JSON object, got list"),
    "missing": (set_field("vocab_size", ...), "vocab_size is missing"),
    "text for a number": (set_field("hidden_size", "big"), "hidden_size must be an integer >= 0, got 'big'"),
    "negative": (set_field("num_layers", -2), "num_layers must be an integer >= 0, got -2"),
    "bool for a number": (set_field("head_dim", True), "head_dim must be an integer >= 0, got True"),
    "nested type": (set_field("rope.theta", "x"), "rope.theta must be a number, got 'x'"),
    "nested not an object": (set_field("rope", [1]), "rope must be an object, got [1]"),
    "list item": (set_field("eos_token_ids", [1, "a"]), "eos_token_ids[1] must be an integer >= 0, got 'a'"),
    "not a list": (set_field("eos_token_ids", 1), "eos_token_ids must be a list, got 1"),
    "unknown choice": (set_field("mtp.layout", "eagle"), "mtp.layout must be one of 'deepseek', 'mimo', 'qwen_next'"),
    "unknown field": (set_field("mtp.depth", 2), "unknown field mtp.depth"),
    "values that do not fit": (set_field("num_heads", 3), "num_attention_heads (3) must be a multiple of"),
}


@pytest.mark.parametrize("kind", sorted(CONVERTED_EDITS))
def test_a_bad_converted_config_is_one_line_naming_the_file_and_the_field(converted, tmp_path, capsys, kind):
    edit, message = CONVERTED_EDITS[kind]
    folder = tmp_path / "model"
    shutil.copytree(converted, folder)
    config_file = folder / "mtp_jax_config.json"
    if isinstance(edit, bytes):
        config_file.write_bytes(edit)
    else:
        config = json.loads(config_file.read_text())
        edit(config)
        config_file.write_text(json.dumps(config))
    code = decode_main(["--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 1 and f"{config_file}: " in err and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_every_config_reads_back_from_its_converted_file(name, tmp_path):
    cfg, path = shapes.shape(name), tmp_path / "mtp_jax_config.json"
    path.write_text(cfg.to_json())
    assert read_converted_config(str(path)) == cfg
    config = json.loads(cfg.to_json())
    del config["rope"], config["mtp"]  # fields with defaults may be left out
    path.write_text(json.dumps(config))
    assert read_converted_config(str(path)) == cfg.replace(rope=RopeConfig(), mtp=None)
