"""`open_source`: the checkpoint source for a path (a .gguf file, a Hugging Face safetensors folder, fp8 or not)."""

from __future__ import annotations

import os

from mtp_jax.params.fp8 import Fp8BlockSource, block_size
from mtp_jax.params.gguf_source import GGUFSource
from mtp_jax.params.source import CheckpointSource, SafetensorsFolderSource
from mtp_jax.runtime.errors import ConversionError


def open_source(path: str) -> CheckpointSource:
    """The source for `path`: a `.gguf` file or a Hugging Face safetensors folder."""
    if not os.path.exists(path):
        raise ConversionError(f"{path}: no such file or folder")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return GGUFSource(path)
    if os.path.isdir(path):
        source = SafetensorsFolderSource(path)
        block = block_size(source.hf_config)
        return source if block is None else Fp8BlockSource(source, block)
    raise ConversionError(f"{path}: expected a Hugging Face model folder or a .gguf file")
