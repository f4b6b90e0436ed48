"""Checkpoint sources: a uniform, lazy view of a checkpoint's tensors under Hugging Face names.

A source gives the HF `config.json` dict, the tensor names, and one tensor at a time as a NumPy array
(memory-mapped where the file format allows), so a conversion never holds the whole checkpoint in memory.
`open_source` picks the reader: a Hugging Face folder of safetensors, or a `.gguf` file.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Iterator

import numpy as np

from checkpoints_convert.errors import ConversionError
from checkpoints_convert.safetensors_reader import SafetensorsFile


class CheckpointSource(abc.ABC):
    """Lazy tensors under Hugging Face key names, plus the HF config and the tokenizer."""

    path: str

    @property
    @abc.abstractmethod
    def hf_config(self) -> dict: ...

    @abc.abstractmethod
    def tensor_names(self) -> list[str]: ...

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as `ml_dtypes.bfloat16`), in HF layout ([out, in] for linears)."""

    @abc.abstractmethod
    def load_tokenizer(self):
        """A `transformers` tokenizer (with its chat template when the checkpoint has one), or None."""

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensor_names())


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class SafetensorsFolderSource(CheckpointSource):
    """A Hugging Face model folder: `config.json` + `model.safetensors` or sharded `*.safetensors` + index."""

    def __init__(self, path: str):
        self.path = path
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ConversionError(f"{path}: no config.json (not a Hugging Face model folder)")
        try:
            with open(config_path) as f:
                self._config = json.load(f)
        except json.JSONDecodeError as e:
            raise ConversionError(f"{config_path}: invalid JSON ({e})") from None
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map", {})
            for name, fname in weight_map.items():
                self._where[name] = fname
            for fname in sorted(set(weight_map.values())):
                self._open(fname)
            for fname, st in self._files.items():
                for name in st.names():
                    if self._where.get(name) != fname:
                        raise ConversionError(
                            f"{fname}: tensor {name} is not listed for this file in model.safetensors.index.json"
                        )
        else:
            shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not shards:
                raise ConversionError(f"{path}: no *.safetensors files")
            for fname in shards:
                for name in self._open(fname).names():
                    if name in self._where:
                        raise ConversionError(f"tensor {name} appears in both {self._where[name]} and {fname}")
                    self._where[name] = fname

    def _open(self, fname: str) -> SafetensorsFile:
        full = os.path.join(self.path, fname)
        if not os.path.isfile(full):
            raise ConversionError(f"{full}: listed in model.safetensors.index.json but missing")
        self._files[fname] = SafetensorsFile(full)
        return self._files[fname]

    @property
    def hf_config(self) -> dict:
        generation_path = os.path.join(self.path, "generation_config.json")
        config = dict(self._config)
        if "eos_token_id" not in config and os.path.isfile(generation_path):
            with open(generation_path) as f:
                config["eos_token_id"] = json.load(f).get("eos_token_id")
        return config

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def read(self, name: str) -> np.ndarray:
        return self._files[self._where[name]].read(name)

    def tokenizer_files(self) -> list[str]:
        return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(self.path, f))]

    def load_tokenizer(self):
        if not any(f.startswith(("tokenizer", "vocab")) for f in self.tokenizer_files()):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)


def open_source(path: str) -> CheckpointSource:
    """The source for `path`: a `.gguf` file or a Hugging Face safetensors folder."""
    if not os.path.exists(path):
        raise ConversionError(f"{path}: no such file or folder")
    if os.path.isfile(path) and path.endswith(".gguf"):
        from checkpoints_convert.gguf_source import GGUFSource

        return GGUFSource(path)
    if os.path.isdir(path):
        from checkpoints_convert.fp8 import Fp8BlockSource, block_size

        source = SafetensorsFolderSource(path)
        block = block_size(source.hf_config)
        return source if block is None else Fp8BlockSource(source, block)
    raise ConversionError(f"{path}: expected a Hugging Face model folder or a .gguf file")
