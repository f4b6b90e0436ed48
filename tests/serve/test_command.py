"""`python -m mtp_jax.serve`'s refusals before any model loads: one line on stderr and a non-zero status."""

from __future__ import annotations

import socket

import pytest

from mtp_jax.cli.serve import default_model_name, main
from mtp_jax.loading.default_model import GGUF_ENV


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--slots", "0"], 2, "error: argument --slots: must be >= 1, got 0"),
        (["--port", "70000"], 1, "error: --port must be in [0, 65535], got 70000"),
        (["--model", "/no/such/model"], 1, "error: /no/such/model: no such model file or folder"),
        (["--round-costs", "1,2"], 1, "error: --round-costs goes with --adaptive"),
        (["--tree", "8", "--no-mtp"], 1, "error: --tree drafts with the MTP head: not with --no-mtp"),
        (["--host", "no-such-host.invalid"], 1, "error: --host no-such-host.invalid: "),
    ],
)
def test_bad_options_are_one_line(capsys, argv, status, message):
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's refusal
        got = e.code
    assert got == status
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_port_in_use_is_refused_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("gguf", "name"),
    [
        (None, "SmolLM2-135M-Instruct"),
        ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("/models/Qwen3-0.6B-Q8_0.gguf", "Qwen3-0.6B"),
        ("/models/Llama-3.2-1B-Instruct-IQ4_XS.gguf", "Llama-3.2-1B-Instruct"),
        ("/models/model-v1.5.gguf", "model-v1.5"),
    ],
)
def test_the_default_model_is_served_under_its_name_without_the_quantization(monkeypatch, gguf, name):
    if gguf is None:
        monkeypatch.delenv(GGUF_ENV, raising=False)
    else:
        monkeypatch.setenv(GGUF_ENV, gguf)
    assert default_model_name() == name
