"""MTP heads trained by this project: saved beside a trunk in the DeepSeek-style key layout, attached on load.

A head folder holds `head.safetensors` (`model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}` + one decoder
layer under `model.layers.{N}.`, plus `mtp.draft_vocab` when drafts use a vocabulary subset) and `head.json`
(the head's `MtpConfig` and the trunk it was trained for).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from mtp_jax.config.model import ModelConfig, MtpConfig
from mtp_jax.conversion.export import hf_tensors
from mtp_jax.conversion.placement import read_params
from mtp_jax.models.causal_lm import CausalLM, model_param_axes
from mtp_jax.parallel.sharding import place_host_array
from mtp_jax.params.safetensors_reader import SafetensorsFile
from mtp_jax.params.tree import abstract_params, assemble, nest
from mtp_jax.runtime.errors import ConversionError, UserError

HEAD_FILE = "head.safetensors"
HEAD_CONFIG = "head.json"
STAGED = ".partial-"  # `.head.safetensors.partial-*`: a head file being written
DRAFT_VOCAB_KEY = "mtp.draft_vocab"
HEAD_FOLDER_NAME = "mtp_head"  # a head inside a model folder is picked up by `load_model`
DEFAULT_HEAD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "shipped_heads", "smollm2-135m-instruct")


def head_for(path: str | None) -> str | None:
    """The head `load_model` attaches by default: the shipped one for the default model, else `mtp_head/`
    inside the model folder (or beside a .gguf as `<file>.mtp_head/`) when present."""
    if path is None:
        candidate = DEFAULT_HEAD
    elif os.path.isdir(path):
        candidate = os.path.join(path, HEAD_FOLDER_NAME)
    else:
        candidate = path + "." + HEAD_FOLDER_NAME
    return candidate if os.path.isfile(os.path.join(candidate, HEAD_CONFIG)) else None


def trunk_fingerprint(cfg: ModelConfig) -> dict:
    return {
        "family": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
    }


def save_head(model: CausalLM, folder: str) -> None:
    """Write the model's MTP head (bf16 for floating tensors) into `folder`, refusing non-finite weights.

    A head there is replaced so that the folder holds the old head, no head or the new one, never a mix: both files
    are written beside their places first, then `head.json` (what marks a head folder) goes, `head.safetensors` and
    `head.json` are renamed into place, in that order. Files a killed save left beside them are removed.
    """
    weights = hf_tensors(model, only_mtp=True)
    bad = [name for name, value in weights.items() if not np.all(np.isfinite(value))]
    if bad:
        raise UserError(f"refusing to save an MTP head with non-finite weights: {', '.join(bad[:3])}")
    tensors = {name: value.astype(ml_dtypes.bfloat16) for name, value in weights.items()}
    if model.draft_vocab is not None:
        tensors[DRAFT_VOCAB_KEY] = np.asarray(model.draft_vocab[...], np.int32)
    meta = {"mtp": dataclasses.asdict(model.config.mtp), "trunk": trunk_fingerprint(model.config)}
    os.makedirs(folder, exist_ok=True)
    for leftover in os.listdir(folder):
        if leftover.startswith((f".{HEAD_FILE}{STAGED}", f".{HEAD_CONFIG}{STAGED}")):
            os.unlink(os.path.join(folder, leftover))
    staged = {name: os.path.join(folder, f".{name}{STAGED}{secrets.token_hex(4)}") for name in (HEAD_FILE, HEAD_CONFIG)}
    try:
        save_file(tensors, staged[HEAD_FILE])
        with open(staged[HEAD_CONFIG], "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(os.path.join(folder, HEAD_CONFIG)):
            os.unlink(os.path.join(folder, HEAD_CONFIG))
        for name in (HEAD_FILE, HEAD_CONFIG):
            os.replace(staged[name], os.path.join(folder, name))
    except BaseException:
        for path in staged.values():
            if os.path.exists(path):
                os.unlink(path)
        raise


def attach_head(model: CausalLM, folder: str) -> CausalLM:
    """A new model: `model`'s trunk with the head saved in `folder` (replacing any head it had)."""
    try:
        with open(os.path.join(folder, HEAD_CONFIG), encoding="utf-8") as f:
            meta = json.load(f)
        head = SafetensorsFile(os.path.join(folder, HEAD_FILE))
        trunk, mtp = meta["trunk"], MtpConfig(**meta["mtp"])
    except (OSError, ValueError, ConversionError) as e:  # ValueError: not UTF-8 JSON
        raise UserError(f"{folder}: not a readable MTP head ({e})") from None
    except KeyError as e:
        raise UserError(f"{os.path.join(folder, HEAD_CONFIG)}: {e.args[0]} is missing") from None
    except TypeError as e:
        raise UserError(f"{os.path.join(folder, HEAD_CONFIG)}: not a head description ({e})") from None
    if trunk != trunk_fingerprint(model.config):
        raise UserError(f"{folder}: head was trained for {trunk}, not this model {trunk_fingerprint(model.config)}")
    cfg = model.config.replace(mtp=mtp)
    dtype = model.dtype
    source = _HeadSource(head, cfg)
    rules = model.sharding_rules  # a model on a mesh gets its head placed beside it, shard by shard
    head_params = read_params(source, cfg, dtype, rules, only_mtp=True)
    trunk = {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model))}  # as stored
    flat = {}
    for path in abstract_params(cfg, dtype):
        if path[0] == "mtp":
            flat[path] = head_params[path]
        elif path == ("draft_vocab",):
            ids = np.asarray(head.read(DRAFT_VOCAB_KEY))  # [Vd]
            on_mesh = rules is not None
            layout = model_param_axes(cfg, dtype)[path]
            flat[path] = place_host_array(ids, rules.sharding(layout, ids.shape)) if on_mesh else jnp.asarray(ids)
        else:
            flat[path] = trunk[path]
    return assemble(cfg, nest(flat), dtype, rules)


class _HeadSource:
    """The head file seen as a checkpoint source holding only MTP tensors."""

    def __init__(self, head, cfg: ModelConfig):
        self._head, self.cfg = head, cfg

    def tensor_names(self) -> list[str]:
        return [n for n in self._head.names() if n != DRAFT_VOCAB_KEY]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._head.shape(name)

    def read(self, name: str) -> np.ndarray:
        return self._head.read(name)
