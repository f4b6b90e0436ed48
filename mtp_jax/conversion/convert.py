"""Checkpoint -> model parameters, with strict accounting; converted folders written (atomically: writer.py).

Accounting: every checkpoint tensor is used or matched by a named ignore rule; every parameter slot is filled
exactly once; every tensor's shape is checked against its parameter before it is read. Which tensor fills which
parameter is the family's key table (mtp_jax/families/).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Iterator

import jax
import ml_dtypes
import numpy as np

from mtp_jax.config.model import ModelConfig
from mtp_jax.conversion.writer import write_folder
from mtp_jax.families.base import Family
from mtp_jax.families.registry import family_of, model_config_from_hf
from mtp_jax.families.tables import (
    FEATURE_FUSION,
    IGNORED_SUFFIXES,
    MTP_FUSION,
    ROUTED_EXPERT,
    TRUNK_ROOT,
    mtp_layer_prefix,
    mtp_prefix,
)
from mtp_jax.models.causal_lm import model_param_matmuls
from mtp_jax.params.fp8 import Fp8BlockSource, scale_index
from mtp_jax.params.source import CheckpointSource
from mtp_jax.params.stored_weights import split_quantized, stored_param, write_manifest
from mtp_jax.params.transforms import WEIGHT_DTYPES, Target
from mtp_jax.params.tree import CONFIG_FILE, PARAMS_DIR, REPORT_FILE, ParamPath, abstract_params, nest
from mtp_jax.quant.formats import stored_format
from mtp_jax.quant.fp8 import fp8_blocks
from mtp_jax.quant.matmul_axes import MatmulAxes
from mtp_jax.runtime.errors import ConversionError


def _layer_targets(
    cfg: ModelConfig, family: Family, prefix: str, stack: ParamPath, index: int, names: frozenset[str]
) -> Iterator[tuple[str, Target]]:
    """The tensors of one decoder layer under `prefix`, filling slot `index` of the layer stack whose layer module
    is at `stack`. `names` (the checkpoint's) tell whether the layer's experts are fused."""
    fused_experts = f"{prefix}mlp.experts.gate_up_proj" in names
    for suffix, path, transform in family.layer_table(cfg, fused_experts):
        yield prefix + suffix, Target((*stack, *path), (index,), transform)
    for e in range(0 if cfg.moe is None or fused_experts else cfg.moe.num_experts):
        for suffix, (path, transform) in ROUTED_EXPERT.items():
            yield f"{prefix}mlp.experts.{e}.{suffix}", Target((*stack, *path), (index, e), transform)


def candidate_targets(cfg: ModelConfig, names: frozenset[str] = frozenset()) -> Iterator[tuple[str, Target]]:
    """Every tensor name this model could read, with its target (the caller keeps those whose parameter exists);
    a tensor that holds several parameters appears once per parameter. `names`: the checkpoint's tensor names,
    where the layout depends on them (fused or per-expert experts)."""
    family = family_of(cfg.family)
    root = family.trunk_prefix(cfg)
    for name, (path, transform) in TRUNK_ROOT.items():
        yield name.replace("model.", root, 1), Target(path, (), transform)
    for s, segment in enumerate(cfg.segments()):
        for r in range(segment.count):
            for j in range(len(segment.kinds)):
                layer = segment.start + r * len(segment.kinds) + j
                stack = ("members", str(j)) if segment.scanned_as_group else ("layers",)
                yield from _layer_targets(cfg, family, f"{root}layers.{layer}.", ("segments", str(s), *stack), r, names)
    if cfg.has_mtp:
        prefix = mtp_prefix(cfg.mtp.layout, cfg.num_layers)
        for suffix, (path, transform) in {**MTP_FUSION[cfg.mtp.layout], **FEATURE_FUSION}.items():
            yield prefix + suffix, Target(("mtp", *path), (), transform)
        layer_prefix = mtp_layer_prefix(cfg.mtp.layout, cfg.num_layers)
        yield from _layer_targets(cfg, family, layer_prefix, ("mtp", "block", "layers"), 0, names)
        for i in range(1, cfg.mtp.block_layers):  # layers stacked by heads trained here
            yield from _layer_targets(cfg, family, f"{prefix}block_layers.{i}.", ("mtp", "block", "layers"), i, names)


@dataclasses.dataclass
class Plan:
    """Which checkpoint tensor fills which parameter slots (one, or several for a fused tensor), and which tensors
    are ignored (and why)."""

    targets: dict[str, list[Target]]
    ignored: dict[str, str]


def plan_conversion(cfg: ModelConfig, params: dict[ParamPath, jax.ShapeDtypeStruct], names: list[str]) -> Plan:
    """Match checkpoint names to the parameter slots of `params` (which may be a subtree of the model's)."""
    expected: dict[str, list[Target]] = {}
    for name, t in candidate_targets(cfg, frozenset(names)):
        if t.path in params:
            expected.setdefault(name, []).append(t)
    present = set(names)
    missing = [n for n in expected if n not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ConversionError(f"missing tensors: {shown}")
    ignored_prefixes = family_of(cfg.family).ignored_prefixes
    ignored, unexpected = {}, []
    for name in names:
        if name in expected:
            continue
        reason = next((why for suffix, why in IGNORED_SUFFIXES.items() if name.endswith(suffix)), None)
        reason = reason or next((why for prefix, why in ignored_prefixes.items() if name.startswith(prefix)), None)
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
    for targets in expected.values():
        for t in targets:
            filled.setdefault(t.path, set()).add(t.index)
    for path, spec in params.items():
        if path == ("draft_vocab",):
            continue
        slots = filled.get(path, set())
        depth = len(next(iter(slots))) if slots else 0
        if not slots or slots != set(itertools.product(*(range(n) for n in spec.shape[:depth]))):
            raise ConversionError(f"parameter {'/'.join(path)} is not filled by the key table")
    return Plan(expected, ignored)


@dataclasses.dataclass(frozen=True)
class ParamReader:
    """One parameter, read from its checkpoint tensors whole or block by block (their shapes already checked).

    tensors: (HF name, target) for every slot of the leading stacked axes (one entry, index (), when unstacked).
    fp8_blocks: for a parameter whose every tensor is stored fp8 with block scales, the per-axis sizes of the boxes
    one of our scales covers (`mtp_jax.quant.fp8.fp8_blocks`, 1 on stacked axes); None otherwise.
    """

    source: CheckpointSource
    shape: tuple[int, ...]
    dtype: np.dtype
    tensors: tuple[tuple[str, Target], ...]
    fp8_blocks: tuple[int, ...] | None = None

    def part_shape(self, part: str) -> tuple[int, ...]:
        if part != "scales":
            return self.shape
        return tuple(n // b for n, b in zip(self.shape, self.fp8_blocks, strict=True))

    def read(self, on_tensor: Callable[[str], None] | None = None, part: str = "dense") -> np.ndarray:
        """The whole parameter (or `part` of it) as a host array."""
        return self.read_blocks([tuple(slice(0, n) for n in self.part_shape(part))], on_tensor, part)[0]

    def read_blocks(
        self, blocks: list[tuple[slice, ...]], on_tensor: Callable[[str], None] | None = None, part: str = "dense"
    ) -> list[np.ndarray]:
        """Host arrays for `blocks` (unit-step slices, one per axis) of the parameter or of `part` of it ("dense":
        the values in the model's dtype, fp8 ones dequantized; "values", "scales": an fp8 parameter as stored),
        reading each tensor once. A block that is a device's shard copies only its part of each (memory-mapped)
        tensor."""
        dtype = {"dense": self.dtype, "values": np.dtype(ml_dtypes.float8_e4m3fn), "scales": np.dtype(np.float32)}
        outs = [np.empty([s.stop - s.start for s in block], dtype[part]) for block in blocks]
        for name, target in self.tensors:
            depth = len(target.index)
            value = None
            for block, out in zip(blocks, outs, strict=True):
                lead = block[:depth]  # this block's range on the stacked axes
                if not all(s.start <= i < s.stop for i, s in zip(target.index, lead, strict=True)):
                    continue
                if value is None:
                    value = self._tensor(name, target, part)
                at = tuple(i - s.start for i, s in zip(target.index, lead, strict=True))
                out[at] = value[block[depth:]].astype(dtype[part])
            if on_tensor is not None:
                on_tensor(name)
        return outs

    def _tensor(self, name: str, target: Target, part: str) -> np.ndarray:
        """One checkpoint tensor in our layout: the whole of this slot of `part`."""
        own = self.shape[len(target.index) :]
        if part == "dense":
            return target.transform(weight(self.source, name), own)
        stored, scale_inv = self.source.read_quantized(name)
        if part == "values":
            return target.transform(stored, own)
        blocks = self.fp8_blocks[len(target.index) :]
        return scale_inv.reshape(-1)[scale_index(stored.shape, self.source.block, target.transform, own, blocks)]


def weight(source: CheckpointSource, name: str) -> np.ndarray:
    """Tensor `name` of `source`, refused unless it holds floating-point values (an integer or bool tensor where a
    weight belongs would be cast silently)."""
    value = np.asarray(source.read(name))
    if value.dtype not in WEIGHT_DTYPES:
        raise ConversionError(f"tensor {name} has dtype {value.dtype}; a weight must be floating-point")
    return value


def param_readers(
    source: CheckpointSource, cfg: ModelConfig, dtype, only_mtp: bool = False
) -> tuple[dict[ParamPath, ParamReader], Plan]:
    """A reader for every parameter (not the draft vocabulary: heads carry it), every tensor's shape checked before
    anything is read. `only_mtp` covers just the MTP head (a head file)."""
    params = abstract_params(cfg, dtype)
    if only_mtp:
        params = {path: spec for path, spec in params.items() if path[0] == "mtp"}
    plan = plan_conversion(cfg, params, source.tensor_names())
    by_path: dict[ParamPath, list[tuple[str, Target]]] = {}
    for name, targets in plan.targets.items():
        for target in targets:
            by_path.setdefault(target.path, []).append((name, target))
    readers, matmuls = {}, model_param_matmuls(cfg, dtype)
    for path, spec in params.items():
        if path == ("draft_vocab",):
            continue
        for name, target in by_path[path]:
            want = target.transform.hf_shape(spec.shape[len(target.index) :])
            got = tuple(source.shape(name))
            if got != want:
                raise ConversionError(f"shape mismatch for {name}: checkpoint has {got}, model expects {want}")
        # the model's dtype, except float32 router biases
        tensors = tuple(by_path[path])
        blocks = _fp8_blocks(path, spec, matmuls.get(path), tensors, source)
        readers[path] = ParamReader(source, tuple(spec.shape), np.dtype(spec.dtype), tensors, blocks)
    return readers, plan


def _fp8_blocks(
    path: ParamPath, spec, matmul: MatmulAxes | None, tensors, source: CheckpointSource
) -> tuple[int, ...] | None:
    """`ParamReader.fp8_blocks` of the parameter at `path` (declaring `matmul`): its scale boxes where every tensor
    is stored fp8 and the parameter is a matmul weight fp8 stores (`--weights fp8`: not an embedding or lm_head);
    None where none is. A matmul weight stored partly fp8, or an fp8 tensor where no such weight is, is refused."""
    quantized = [isinstance(source, Fp8BlockSource) and source.is_quantized(name) for name, _ in tensors]
    if not any(quantized):
        return None
    stored = stored_format(matmul, "fp8") is not None
    if not stored or not all(quantized):
        where = "a weight whose other slots are not" if stored else "a parameter that is no matmul weight"
        raise ConversionError(f"{tensors[quantized.index(True)][0]} is stored fp8 for {where} ({'/'.join(path)})")
    return fp8_blocks(spec.shape, matmul.contracting, matmul.batched, block=source.block)


def convert_params(
    source: CheckpointSource,
    cfg: ModelConfig,
    dtype,
    place: Callable[[ParamPath, np.ndarray], jax.Array] | None = None,
    on_tensor: Callable[[str], None] | None = None,
    only_mtp: bool = False,
    weights: str = "bfloat16",
) -> tuple[dict[ParamPath, object], Plan]:
    """Fill every parameter from `source`, one parameter at a time (its stacked slots read tensor by tensor).

    `place(path, array)` puts a finished host array where it belongs (a device, a sharding); by default it stays
    a NumPy array. `only_mtp` fills just the MTP head (a head file). `weights`: how matmul weights are stored
    (`params.stored_weights.stored_param`: "bfloat16" in `dtype`; "auto" keeps a checkpoint's fp8; "int8" and "fp8"
    quantize), a quantized one as a `QuantizedArray` of NumPy arrays. Returns the flat parameters and the plan.
    """
    readers, plan = param_readers(source, cfg, dtype, only_mtp)
    matmuls = model_param_matmuls(cfg, dtype)
    out = {}
    for path, reader in readers.items():
        array = stored_param(reader, weights, matmuls.get(path), dtype, on_tensor)
        out[path] = place(path, array) if place is not None else array
    return out, plan


def write_converted(dst: str, cfg: ModelConfig, params: dict, tokenizer, report: dict, overwrite: bool) -> None:
    """Write config, orbax params (quantized weights as stored: `params.stored_weights`) and tokenizer into the new
    folder `dst`, atomically (`writer.write_folder`)."""

    def fill(folder: str) -> None:
        with open(os.path.join(folder, CONFIG_FILE), "w") as f:
            f.write(cfg.to_json())
        flat, manifest = split_quantized(params)
        import orbax.checkpoint as ocp  # heavy to import: only where a folder is written or read

        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(folder, PARAMS_DIR), nest(flat))
        write_manifest(folder, manifest)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        with open(os.path.join(folder, REPORT_FILE), "w") as f:
            json.dump(report, f, indent=2)

    write_folder(dst, overwrite, fill)


def config_of(source: CheckpointSource) -> ModelConfig:
    """The model config of a checkpoint: its config.json mapped (a bad field refused naming the file and the field),
    then what only the tensors tell (the MTP layer's presence and its embedding / head copies)."""
    hf = source.hf_config
    try:
        cfg = model_config_from_hf(hf)
    except ConversionError as e:
        raise ConversionError(f"{source.config_file}: {e}") from None
    return resolve_mtp_tensors(source, cfg)


def _same_tensor(source: CheckpointSource, a: str, b: str, rows_per_chunk: int = 4096) -> bool:
    if tuple(source.shape(a)) != tuple(source.shape(b)):
        return False
    x, y = source.read(a), source.read(b)
    return all(
        np.array_equal(x[i : i + rows_per_chunk], y[i : i + rows_per_chunk]) for i in range(0, len(x), rows_per_chunk)
    )


def resolve_mtp_tensors(source: CheckpointSource, cfg: ModelConfig) -> ModelConfig:
    """A config announcing an MTP layer whose checkpoint has none of its tensors (stripped uploads) has no MTP head.
    DeepSeek-layout MTP layers may carry their own `embed_tokens` / `shared_head.head`: a copy equal to the trunk's
    tensor is the shared weight (ignored); a different one stays the MTP layer's own."""
    if not cfg.has_mtp:
        return cfg
    prefix = mtp_prefix(cfg.mtp.layout, cfg.num_layers)
    names = set(source.tensor_names())
    if not any(n.startswith(prefix) for n in names):
        return cfg.replace(mtp=None)
    if cfg.mtp.layout != "deepseek":
        return cfg
    trunk_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    own = {}
    for flag, copy, trunk in (
        ("own_embedding", prefix + "embed_tokens.weight", "model.embed_tokens.weight"),
        ("own_head", prefix + "shared_head.head.weight", trunk_head),
    ):
        own[flag] = copy in names and trunk in names and not _same_tensor(source, copy, trunk)
    return cfg.replace(mtp=dataclasses.replace(cfg.mtp, **own))
