"""Checkpoint -> model parameters, with strict accounting, and the atomic writer of converted folders.

Accounting: every checkpoint tensor is used or matched by a named ignore rule; every parameter slot is filled
exactly once; every tensor's shape is checked against its parameter before it is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np
from flax import nnx

from checkpoints_convert.errors import ConversionError
from checkpoints_convert.hf_config import model_config_from_hf
from checkpoints_convert.key_table import (
    DECODER_LAYER,
    IGNORED_SUFFIXES,
    MTP_FUSION,
    TRUNK_ROOT,
    Target,
    mtp_prefix,
)
from checkpoints_convert.source import CheckpointSource
from mtp_jax.checkpoint import CONFIG_FILE
from mtp_jax.config import ModelConfig
from mtp_jax.models.causal_lm import CausalLM

PARAMS_DIR = "params"
REPORT_FILE = "conversion.json"

ParamPath = tuple[str, ...]


def abstract_params(cfg: ModelConfig, dtype) -> dict[ParamPath, jax.ShapeDtypeStruct]:
    """Every parameter of the model for `cfg`, by path, without allocating it."""
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype))
    return {
        tuple(str(p) for p in path): jax.ShapeDtypeStruct(v.shape, v.dtype)
        for path, v in nnx.to_flat_state(nnx.state(model))
    }


def candidate_targets(cfg: ModelConfig) -> Iterator[tuple[str, Target]]:
    for name, (path, transform) in TRUNK_ROOT.items():
        yield name, Target(path, None, transform)
    for i in range(cfg.num_layers):
        for suffix, (path, transform) in DECODER_LAYER.items():
            yield f"model.layers.{i}.{suffix}", Target(("layers", "layers", *path), i, transform)
    if cfg.has_mtp:
        prefix = mtp_prefix(cfg.mtp.layout, cfg.num_layers)
        for suffix, (path, transform) in MTP_FUSION[cfg.mtp.layout].items():
            yield prefix + suffix, Target(("mtp", *path), None, transform)
        for suffix, (path, transform) in DECODER_LAYER.items():
            yield prefix + suffix, Target(("mtp", "block", "layers", *path), 0, transform)


@dataclasses.dataclass
class Plan:
    """Which checkpoint tensor fills which parameter slot, and which tensors are ignored (and why)."""

    targets: dict[str, Target]
    ignored: dict[str, str]


def plan_conversion(cfg: ModelConfig, params: dict[ParamPath, jax.ShapeDtypeStruct], names: list[str]) -> Plan:
    """Match checkpoint names to the parameter slots of `params` (which may be a subtree of the model's)."""
    expected = {name: t for name, t in candidate_targets(cfg) if t.path in params}
    present = set(names)
    missing = [n for n in expected if n not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ConversionError(f"missing tensors: {shown}")
    ignored, unexpected = {}, []
    for name in names:
        if name in expected:
            continue
        reason = next((why for suffix, why in IGNORED_SUFFIXES.items() if name.endswith(suffix)), None)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            reason = "tied to the embedding"
        if reason is None:
            unexpected.append(name)
        else:
            ignored[name] = reason
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else "")
        raise ConversionError(f"unexpected tensors: {shown}")
    filled: dict[ParamPath, set] = {}
    for t in expected.values():
        filled.setdefault(t.path, set()).add(t.index)
    for path, spec in params.items():
        if path == ("draft_vocab",):
            continue
        slots = filled.get(path, set())
        stacked = any(index is not None for index in slots)
        if not slots or slots != (set(range(spec.shape[0])) if stacked else {None}):
            raise ConversionError(f"parameter {'/'.join(path)} is not filled by the key table")
    return Plan(expected, ignored)


def convert_params(
    source: CheckpointSource,
    cfg: ModelConfig,
    dtype,
    place: Callable[[ParamPath, np.ndarray], jax.Array] | None = None,
    on_tensor: Callable[[str], None] | None = None,
    only_mtp: bool = False,
) -> tuple[dict[ParamPath, object], Plan]:
    """Fill every parameter from `source`, one parameter at a time (its stacked slots read tensor by tensor).

    `place(path, array)` puts a finished host array where it belongs (a device, a sharding); by default it stays
    a NumPy array. `only_mtp` fills just the MTP head (a head file). Returns the flat parameters and the plan.
    """
    params = abstract_params(cfg, dtype)
    if only_mtp:
        params = {path: spec for path, spec in params.items() if path[0] == "mtp"}
    plan = plan_conversion(cfg, params, source.tensor_names())
    by_path: dict[ParamPath, list[tuple[str, Target]]] = {}
    for name, target in plan.targets.items():
        by_path.setdefault(target.path, []).append((name, target))
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    out = {}
    for path, spec in params.items():
        if path == ("draft_vocab",):
            continue
        array = np.empty(spec.shape, np_dtype)
        for name, target in by_path[path]:
            slot_shape = spec.shape if target.index is None else spec.shape[1:]
            want = target.transform.hf_shape(slot_shape)
            got = tuple(source.shape(name))
            if got != want:
                raise ConversionError(f"shape mismatch for {name}: checkpoint has {got}, model expects {want}")
            value = target.transform(np.asarray(source.read(name)), slot_shape).astype(np_dtype)
            if target.index is None:
                array[...] = value
            else:
                array[target.index] = value
            if on_tensor is not None:
                on_tensor(name)
        out[path] = place(path, array) if place is not None else array
    return out, plan


def nest(flat: dict[ParamPath, object]) -> dict:
    """{('a', 'b'): x} -> {'a': {'b': x}}."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def write_converted(dst: str, cfg: ModelConfig, params: dict, tokenizer, report: dict, overwrite: bool) -> None:
    """Write config, orbax params and tokenizer into a temp folder beside `dst`, then rename it into place."""
    import orbax.checkpoint as ocp

    dst = os.path.abspath(dst)
    if os.path.exists(dst) and not overwrite:
        raise ConversionError(f"{dst} already exists (use --overwrite)")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.partial-", dir=parent)
    try:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(cfg.to_json())
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(tmp, PARAMS_DIR), nest(params))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, REPORT_FILE), "w") as f:
            json.dump(report, f, indent=2)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def config_of(source: CheckpointSource) -> ModelConfig:
    return model_config_from_hf(source.hf_config)
