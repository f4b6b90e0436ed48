"""`--model ORG/NAME[@REVISION]`: a Hugging Face Hub repo id, resolved to a local snapshot folder of the hub cache.

An existing local path always wins; a string that is not one and not a repo id is passed on unchanged (the loader
then says "no such file or folder"). The hub library does the rest as it always does: HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE and tokens (HF_TOKEN, `hf auth login`). Only the files a load reads are fetched.
"""

from __future__ import annotations

import os
import re

from huggingface_hub import constants
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from mtp_jax.params.source import CONFIG_JSON, INDEX_JSON, TOKENIZER_FILES
from mtp_jax.runtime.errors import UserError

# What `load_model` reads from a Hugging Face folder: config, tokenizer and generation config, top-level weights.
NEEDED_FILES = [CONFIG_JSON, *TOKENIZER_FILES, INDEX_JSON, "*.safetensors"]
SUBFOLDERS = ["*/*"]  # e.g. original/, onnx/: other copies of the weights that a load never reads
MODEL_HELP = "a Hugging Face folder or repo id ORG/NAME[@REVISION], a converted folder or a .gguf"
REPO_REF = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^@\s]+))?")


def repo_ref(text: str | os.PathLike) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `text` reads as `ORG/NAME[@REVISION]` and names no existing path, else None."""
    match = REPO_REF.fullmatch(text) if isinstance(text, str) else None
    if match is None or os.path.exists(text) or text.endswith(".gguf"):
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return match["repo"], match["revision"]


def names_a_model(text: str | os.PathLike) -> bool:
    """Whether `text` is an existing path or a Hugging Face repo id (whether the repo exists is not checked)."""
    return os.path.exists(text) or repo_ref(text) is not None


def local_path(text: str | os.PathLike, files: list[str] = NEEDED_FILES) -> str | os.PathLike:
    """`text` itself unless it is a repo id (see `repo_ref`); then the snapshot folder holding `files` (patterns;
    by default those a load reads), downloaded into the hub cache when not there yet."""
    ref = repo_ref(text)
    if ref is None:
        return text
    repo, revision = ref
    from huggingface_hub import snapshot_download  # the hub client, slow to import: only for a repo id

    try:
        return snapshot_download(repo, revision=revision, allow_patterns=files, ignore_patterns=SUBFOLDERS)
    except LocalEntryNotFoundError as e:
        raise UserError(f"{text}: {not_cached(repo, revision, e)}") from e
    except RevisionNotFoundError as e:
        raise UserError(f"{text}: Hugging Face repo {repo} has no revision {revision}") from e
    except RepositoryNotFoundError as e:  # also a gated repo, or a private one without a token
        raise UserError(
            f"{text}: no such file or folder, and no Hugging Face repo {repo} that this token can read "
            "(a private or gated repo needs HF_TOKEN or `hf auth login`)"
        ) from e
    except HfHubHTTPError as e:
        raise UserError(f"{text}: Hugging Face Hub error: {first_line(e)}") from e


def not_cached(repo: str, revision: str | None, error: Exception) -> str:
    where = f"Hugging Face repo {repo} (revision {revision or constants.DEFAULT_REVISION})"
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        return f"{where} is not (completely) in the hub cache {cache}, and HF_HUB_OFFLINE is set: offline, not fetched"
    return f"{where} is not (completely) in the hub cache {cache}, and the Hub was not reached: {first_line(error)}"


def first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
