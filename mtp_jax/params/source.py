"""Checkpoint sources: a uniform, lazy view of a checkpoint's tensors under Hugging Face names.

A source gives the HF `config.json` dict, the tensor names, and one tensor at a time as a NumPy array
(memory-mapped where the file format allows), so a conversion never holds the whole checkpoint in memory.
`open_source` (mtp_jax/params/open_source.py) picks the reader: a Hugging Face folder of safetensors, or a `.gguf` file.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Iterator

import numpy as np

from mtp_jax.params.safetensors_reader import SafetensorsFile
from mtp_jax.runtime.errors import ConversionError
from mtp_jax.runtime.transformers_import import import_transformers


class CheckpointSource(abc.ABC):
    """Lazy tensors under Hugging Face key names, plus the HF config and the tokenizer."""

    path: str

    @property
    def config_file(self) -> str:
        """The file the HF config comes from: a folder's config.json, or a single-file checkpoint itself."""
        return os.path.join(self.path, CONFIG_JSON) if os.path.isdir(self.path) else self.path

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


CONFIG_JSON, INDEX_JSON, GENERATION_JSON = "config.json", "model.safetensors.index.json", "generation_config.json"


def read_json_object(path: str) -> dict:
    """The JSON object in file `path`; a file that cannot be read, or is not UTF-8 JSON of an object, is refused with
    one line naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise ConversionError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


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
        config_path = os.path.join(path, CONFIG_JSON)
        if not os.path.isfile(config_path):
            raise ConversionError(f"{path}: no {CONFIG_JSON} (not a Hugging Face model folder)")
        self._config = read_json_object(config_path)
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        index_path = os.path.join(path, INDEX_JSON)
        if os.path.isfile(index_path):
            weight_map = read_json_object(index_path).get("weight_map")
            files = list(weight_map.values()) if isinstance(weight_map, dict) else []
            if not files or not all(isinstance(f, str) for f in files):
                raise ConversionError(f"{index_path}: weight_map is missing or not a {{tensor name: file name}} object")
            self._where.update(weight_map)
            for fname in sorted(set(files)):
                if not os.path.isfile(os.path.join(path, fname)):
                    raise ConversionError(f"{index_path}: names {fname}, which does not exist")
                self._open(fname)
            for fname, st in self._files.items():
                for name in st.names():
                    if self._where.get(name) != fname:
                        raise ConversionError(f"{fname}: tensor {name} is not listed for this file in {index_path}")
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
        self._files[fname] = SafetensorsFile(os.path.join(self.path, fname))
        return self._files[fname]

    @property
    def hf_config(self) -> dict:
        generation_path = os.path.join(self.path, GENERATION_JSON)
        config = dict(self._config)
        if "eos_token_id" not in config and os.path.isfile(generation_path):
            config["eos_token_id"] = read_json_object(generation_path).get("eos_token_id")
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
        return import_transformers().AutoTokenizer.from_pretrained(self.path)
