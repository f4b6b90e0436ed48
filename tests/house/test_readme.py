"""The README as a user reads it: short, its set-up commands first, its links alive, and every Python block and every
command in it that runs on a CPU run as written (decoding budgets cut to a few tokens; the server started, asked
for its health and stopped)."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mtp_jax.loading.default_model import GGUF_ENV

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SET_UP = [
    'pip install -e . && python -m mtp_jax.decode --prompt "Explain speculative decoding in one paragraph."',
    'pip install -e ".[test]" && python -m pytest -q',
]
MAX_LINES = 220
# appended to the decoding commands (argparse keeps the last value)
SMALL_BUDGETS = {
    "mtp_jax.decode": ["--max-new-tokens", "4"],
    "mtp_jax.bench": ["--max-new-tokens", "4", "--repeats", "1"],
}


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def commands() -> list[str]:
    """Every line of the README's bash blocks, comments taken off, continuation lines joined."""
    lines = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines


def test_the_readme_is_short_and_opens_with_the_two_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert text.splitlines()[: len(SET_UP) + 2] == ["```bash", *SET_UP, "```"]
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated numbers belong in docs/benchmarks.md"
    assert not re.search(r"\b\d+ (passed|tests)\b", text), "test counts change with every commit"


def test_every_relative_link_of_the_readme_and_the_topic_pages_exists():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing


@pytest.fixture
def default_model_env(smollm2_path, monkeypatch, tmp_path):
    """The default model found offline, commands run in an empty folder."""
    monkeypatch.setenv(GGUF_ENV, smollm2_path)
    monkeypatch.chdir(tmp_path)
    return {**os.environ, GGUF_ENV: smollm2_path}


@pytest.mark.slow
def test_the_readmes_python_blocks_run_as_written(default_model_env, optimized_compiles, capsys):
    scope: dict = {}
    for block in blocks("python"):
        exec(compile(block, "README.md", "exec"), scope)
    assert capsys.readouterr().out.strip()
    assert scope["out"].tokens.shape == (2, scope["cfg"].max_new_tokens)  # the last block's `generate`


def run_module_command(words: list[str]) -> int:
    """`python -m MODULE ARGS...` run in this process: its exit status."""
    module, argv = words[2], words[3:]
    argv = [*argv, *SMALL_BUDGETS.get(module, [])]
    saved = sys.argv
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    except SystemExit as e:
        return 0 if e.code is None else int(e.code)
    finally:
        sys.argv = saved
    return 0


def serve_until_healthy(words: list[str], env: dict, timeout_s: float = 300) -> None:
    """The server command, on a free port instead of the one written: up until GET /health answers 200."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, *words[1:]]
    argv[argv.index("--port") + 1] = str(port)
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(1)
        pytest.fail(f"the server did not answer /health within {timeout_s} s")
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.slow
def test_the_readmes_commands_run_as_written(default_model_env, optimized_compiles, capsys):
    ran = []
    for line in commands():
        if line in SET_UP:
            continue  # .ci/run and tests/loading/test_warm_start.py run these in fresh environments
        words = shlex.split(line)
        if words[:2] == ["python", "-m"] and words[2] == "mtp_jax.serve":
            serve_until_healthy(words, default_model_env)
        elif words[:2] == ["python", "-m"]:
            assert run_module_command(words) == 0, (line, capsys.readouterr().err)
        else:
            subprocess.run(["bash", "-c", line], check=True)
        ran.append(words[:3])
    assert ["python", "-m", "mtp_jax.serve"] in ran and ["python", "-m", "mtp_jax.bench"] in ran
    assert Path("out.jsonl").read_text().count("\n") == 2  # the prompts file's two answers
