"""`python -m mtp_jax.decode` under kills and bad input: finished rows survive a kill and --resume continues from
them; unwritable outputs, non-UTF-8 prompts and budgets past the context or memory are one line before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.decode import speculative
from mtp_jax.loading import checkpoint
from mtp_jax.runtime.files import write_atomically
from tests.support.commands import ROOT
from tests.support.tiny_models import tiny_config

PROMPTS = [[5, 6, 7, 8, 9], [11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [30, 31]]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "hf"
    cfg = tiny_config("deepseek", vocab=40, eos=(2,)).replace(max_position_embeddings=64)
    save_hf_folder(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(3)), folder)
    return folder


def write_prompts(path, prompts=PROMPTS):
    path.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    return path


def argv(model_folder, prompts, out, *extra) -> list[str]:
    common = ["--model", model_folder, "--prompts-file", prompts, "--out", out, "--max-new-tokens", 12]
    return [str(a) for a in [*common, "--batch-size", 2, "--dtype", "float32", "--num-draft", 2, *extra]]


def decode(capsys, *args) -> tuple[int, str]:
    code = decode_main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def reference(model_folder, tmp_path_factory):
    """The output of one uninterrupted run over PROMPTS (five prompts through two slots)."""
    root = tmp_path_factory.mktemp("reference")
    assert decode_main(argv(model_folder, write_prompts(root / "p.jsonl"), root / "out.jsonl")) == 0
    lines = (root / "out.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 5
    return lines


def partials(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".partial-" in n)


CHILD = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, even if the runner ignores it
from mtp_jax.cli import decode_output
from mtp_jax.cli.decode import main

real_write, written = decode_output.RowOutput.write, []

def write(self, rows):  # rows reach the output in input order, as the rows before them are done
    real_write(self, rows)
    written.extend(rows)
    if len(written) == 4:  # killed while the last row decodes
        os.kill(os.getpid(), signal.{signal})

decode_output.RowOutput.write = write
sys.exit(main(sys.argv[1:]))
"""


def run_child(signal: str, args: list[str]) -> subprocess.CompletedProcess:
    script = CHILD.format(signal=signal)
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.slow
def test_a_killed_run_keeps_its_finished_rows_and_resume_completes_it(model_folder, reference, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    args = argv(model_folder, write_prompts(tmp_path / "p.jsonl"), out)
    child = run_child("SIGKILL", args)  # killed while decoding the fifth row
    assert child.returncode == -9, child.stderr
    assert not out.exists() and len(partials(tmp_path)) == 1
    partial = tmp_path / partials(tmp_path)[0]
    assert partial.read_text().splitlines(keepends=True) == reference[:4]  # four whole rows
    code, err = decode(capsys, *args)
    assert code == 1 and "--resume" in err and len(err.strip().splitlines()) == 1, err  # a fresh run would lose them
    code, err = decode(capsys, *args, "--resume")
    assert code == 0, err
    assert "4 finished rows kept" in err and "for 1 prompt(s)" in err  # only the fifth row was decoded
    assert out.read_text().splitlines(keepends=True) == reference and partials(tmp_path) == []


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_a_row_cut_short_is_dropped_on_resume(model_folder, reference, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    args = argv(model_folder, write_prompts(tmp_path / "p.jsonl"), out)
    child = run_child("SIGINT", args)
    assert child.returncode == 130 and "Traceback" not in child.stderr, child.stderr
    partial = tmp_path / partials(tmp_path)[0]
    last = child.stderr.strip().splitlines()[-1]
    assert last == f"interrupted: 4 finished rows kept in {partial}; rerun with --resume to continue"
    with open(partial, "a") as f:
        f.write(reference[4][:20])  # a row cut short by a kill in the middle of its write
    code, err = decode(capsys, *args, "--resume")
    assert code == 0, err
    assert out.read_text().splitlines(keepends=True) == reference and partials(tmp_path) == []


@pytest.mark.slow
def test_resume_continues_a_complete_output_over_more_prompts(model_folder, reference, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert decode(capsys, *argv(model_folder, write_prompts(tmp_path / "p.jsonl", PROMPTS[:3]), out))[0] == 0
    code, err = decode(capsys, *argv(model_folder, write_prompts(tmp_path / "p.jsonl"), out, "--resume"))
    assert code == 0 and f"3 finished rows kept from {out}" in err and "for 2 prompt(s)" in err, err
    assert out.read_text().splitlines(keepends=True) == reference
    code, err = decode(capsys, *argv(model_folder, tmp_path / "p.jsonl", out, "--resume"))
    assert code == 0 and "nothing decoded" in err, err
    assert out.read_text().splitlines(keepends=True) == reference


@pytest.mark.slow
def test_resume_refuses_rows_of_other_prompts_or_settings(model_folder, reference, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("".join(reference))
    other = write_prompts(tmp_path / "other.jsonl", [[9, 9], *PROMPTS[1:]])
    code, err = decode(capsys, *argv(model_folder, other, out, "--resume"))
    assert code == 1 and "row 0 is not for prompt 0" in err and len(err.strip().splitlines()) == 1, err
    assert out.read_text() == "".join(reference) and partials(tmp_path) == []

    stale = tmp_path / "out.jsonl.partial-000000000000"  # another run's, other settings
    stale.write_text("".join(reference[:2]))
    code, err = decode(capsys, *argv(model_folder, write_prompts(tmp_path / "p.jsonl"), out, "--resume"))
    assert code == 1 and "other settings" in err and len(err.strip().splitlines()) == 1, err
    assert stale.read_text() == "".join(reference[:2]) and partials(tmp_path) == [stale.name]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails a test that loads the model: its refusal must come before any work."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(checkpoint, "load", load)


@pytest.mark.parametrize(
    ("option", "make", "message"),
    [
        ("--out", lambda p: (p / "x").mkdir(), "--out {x}: is a folder"),
        ("--stats-json", lambda p: (p / "x").mkdir(), "--stats-json {x}: is a folder"),
        ("--out", lambda p: (p / "f").write_text(""), "is a file, not a folder"),
    ],
)
def test_unwritable_output_paths_are_refused_before_any_work(
    model_folder, tmp_path, capsys, no_model_load, option, make, message
):
    make(tmp_path)
    target = tmp_path / "x" if (tmp_path / "x").exists() else tmp_path / "f" / "out.jsonl"
    args = ["--model", str(model_folder), "--prompt", "hi", option, str(target)]
    code, err = decode(capsys, *args)
    assert code == 1 and message.format(x=target) in err and len(err.strip().splitlines()) == 1, err
    assert partials(tmp_path) == []


def test_write_atomically_leaves_no_partial_file_when_it_fails(tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomically(str(tmp_path / "folder"), "text")
    assert partials(tmp_path) == []


def test_a_prompts_file_that_is_not_utf8_is_one_line(model_folder, tmp_path, capsys, no_model_load):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"token_ids": [5]}\n{"prompt": "caf\xe9"}\n')
    code, err = decode(capsys, "--model", str(model_folder), "--prompts-file", str(path))
    assert code == 1 and f"{path}:2: not UTF-8 text (byte 0xe9)" in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture
def no_compile(monkeypatch):
    """Fails a test that compiles the decode loop: its refusal must come before."""

    def compile_generate(*args, **kwargs):
        raise AssertionError("the decode loop was compiled")

    monkeypatch.setattr(speculative, "compile_generate", compile_generate)


def test_a_budget_past_the_context_is_refused_before_compiling(model_folder, tmp_path, capsys, no_compile):
    out = tmp_path / "out.jsonl"
    args = argv(model_folder, write_prompts(tmp_path / "p.jsonl"), out, "--max-new-tokens", 60)
    code, err = decode(capsys, *args)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "--max-new-tokens 60: the longest prompt (7 tokens)" in err and "67 positions" in err and "is 64" in err
    assert not out.exists() and partials(tmp_path) == []


def test_caches_that_cannot_fit_in_memory_are_refused_before_compiling(tmp_path, capsys, no_compile):
    cfg = tiny_config("deepseek", vocab=40, eos=(2,)).replace(max_position_embeddings=10**13)
    save_hf_folder(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(3)), tmp_path / "hf")
    prompts = write_prompts(tmp_path / "p.jsonl")
    code, err = decode(capsys, *argv(tmp_path / "hf", prompts, tmp_path / "out.jsonl", "--max-new-tokens", 10**12))
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "--max-new-tokens 1000000000000 with --batch-size 2: the caches (" in err and "of this machine's RAM" in err
