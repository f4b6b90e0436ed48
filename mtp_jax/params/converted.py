"""A converted folder (written by `python -m checkpoints_convert`, or the warm-start cache of the default model): its
model config, checked field by field against the dataclasses, and its parameters (orbax, or one safetensors file),
restored straight into their shardings."""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import jax
import jax.numpy as jnp

from mtp_jax.config.model import ModelConfig
from mtp_jax.models.causal_lm import CausalLM, model_param_axes
from mtp_jax.parallel.sharding import ShardingRules
from mtp_jax.params.source import read_json_object
from mtp_jax.params.state_file import STATE_FILE, read_state
from mtp_jax.params.stored_weights import as_quantized, quantized_target, read_manifest
from mtp_jax.params.tree import CONFIG_FILE, PARAMS_DIR, abstract_params, assemble, nest
from mtp_jax.runtime.errors import ConversionError


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_converted_config(path: str) -> ModelConfig:
    """The `ModelConfig` in a converted folder's mtp_jax_config.json (`path`: the file). A file that is not one (not
    JSON, a field missing, unknown or of the wrong type, values that do not fit together) is refused with one line
    naming the file and the field."""
    raw = read_json_object(path)
    try:
        return _from_dict(ModelConfig, raw, "")
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(f"{path}: not an mtp_jax model config ({e})") from None


def _from_dict(cls, raw: dict, where: str):
    """Dataclass `cls` from its `dataclasses.asdict` form, every field checked against its annotation; `where`: the
    prefix of the fields' names in messages."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"unknown field {where}{unknown[0]}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, field in fields.items():
        if name in raw:
            values[name] = _field_value(hints[name], raw[name], where + name)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}{name} is missing")
    return cls(**values)


SCALAR_FIELDS = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer >= 0", lambda v: type(v) is int and v >= 0),  # every int field is a size, a count or an id
    float: ("a number", lambda v: type(v) in (int, float)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _field_value(hint, value, name: str):
    """`value` as the field `name` of type `hint` holds it: a dataclass from a dict, a tuple from a list."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:  # X | None: the only unions the configs use
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        return _field_value(hint, value, name)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be an object, got {value!r}")
        return _from_dict(hint, value, f"{name}.")
    if origin is tuple:  # tuple[X, ...]
        if not isinstance(value, list):
            raise TypeError(f"{name} must be a list, got {value!r}")
        return tuple(_field_value(args[0], v, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    wanted, valid = SCALAR_FIELDS[hint]
    if not valid(value):
        raise TypeError(f"{name} must be {wanted}, got {value!r}")
    return value


def restore_converted(path: str, dtype, rules: ShardingRules | None) -> CausalLM:
    """Every parameter restored straight into its target sharding (or onto the default device): from the folder's
    `params.safetensors` where it has one (`state_file`), else by orbax from its `params/` checkpoint, weights that
    it stores quantized as they are stored (`stored_weights`)."""
    cfg = read_converted_config(os.path.join(path, CONFIG_FILE))
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return assemble(cfg, read_state(os.path.join(path, STATE_FILE), cfg, dtype, rules), dtype, rules)

    layouts, quantized = model_param_axes(cfg, dtype), read_manifest(path)

    def target(param_path, spec):
        sharding_of = lambda shape: None if rules is None else rules.sharding(layouts[param_path], shape)
        entry = quantized.get("/".join(param_path))
        if entry is None:
            return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding_of(spec.shape))
        return quantized_target(spec, entry, sharding_of)

    flat = {p: target(p, s) for p, s in abstract_params(cfg, dtype).items()}
    import orbax.checkpoint as ocp  # heavy to import: only where a folder is written or read

    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)), nest(flat))
    return assemble(cfg, as_quantized(params, jnp.dtype(dtype)), dtype, rules)
