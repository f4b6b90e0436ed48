"""`load_model`: a converted folder, a Hugging Face folder or a .gguf (or the default model) -> `CausalLM`."""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from checkpoints_convert.errors import ConversionError
from checkpoints_convert.source import read_json_object
from mtp_jax.config import ModelConfig
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.quant import QuantizedArray, is_quantized, quantize_model
from mtp_jax.sharding import ShardingRules, place, rules_for


def default_dtype():
    """float32 on CPU (XLA's CPU bf16 matmuls are slow), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


CONFIG_FILE = "mtp_jax_config.json"  # marks a converted folder (checkpoints_convert writes it)


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


def assemble(cfg: ModelConfig, params: dict, dtype, rules: ShardingRules | None = None) -> CausalLM:
    """A `CausalLM` whose parameters are `params` (nested dict of arrays in the model's state layout); `rules`: the
    sharding rules they were placed with, kept on the model so `generate` lays out caches and activations to match."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype)))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    model.sharding_rules = rules
    return model


def _restore_converted(path: str, dtype, rules: ShardingRules | None) -> CausalLM:
    """Orbax restores every parameter straight into its target sharding (or onto the default device)."""
    import orbax.checkpoint as ocp

    from checkpoints_convert.convert import PARAMS_DIR, abstract_params, nest

    cfg = read_converted_config(os.path.join(path, CONFIG_FILE))

    def target(param_path, spec):
        sharding = None if rules is None else rules.param_sharding(param_path, spec.shape)
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)

    targets = nest({p: target(p, s) for p, s in abstract_params(cfg, dtype).items()})
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)), targets)
    return assemble(cfg, params, dtype, rules)


def load(
    path: str | None = None,
    *,
    dtype=None,
    mesh: Mesh | ShardingRules | None = None,
    head: str | None = None,
    default_head: bool = True,
    weights: str = "auto",
):
    """(model, tokenizer or None) for `path`; None means the default model.

    `mesh`: a `jax.sharding.Mesh` (default rules of `mtp_jax.sharding`) or `ShardingRules`; every parameter is then
    placed directly into its sharding, and each process reads only the parts of the tensors its devices hold.

    `head`: a head folder written by `python -m mtp_jax.train_head`; without one, the shipped head of the default
    model, or an `mtp_head/` folder inside the model folder, is attached when present (`default_head=False`: not;
    e.g. to train a new head on the bare trunk).

    `weights` (`mtp_jax.quant`): "auto" keeps the weights as the checkpoint ships them (fp8 with block scales stays
    fp8, dequantized inside the jitted step; the rest in `dtype`); "bfloat16" dequantizes everything into `dtype`;
    "int8" stores every matmul weight (trunk and MTP layer) as int8 with per-channel scales; "fp8" keeps an fp8
    checkpoint as shipped and stores every matmul weight of any other as fp8 with 128 x 128 block scales.
    """
    from mtp_jax.heads import attach_head, head_for

    model, tokenizer = _load_trunk(path, dtype=dtype, mesh=mesh, weights=weights)
    head = head or (head_for(path) if default_head else None)
    model = attach_head(model, head) if head else model
    if weights == "fp8" and is_quantized(model):  # the checkpoint's own fp8: which weights it left alone stays so
        return model, tokenizer
    return quantize_model(model, weights), tokenizer


def _load_trunk(path, *, dtype, mesh, weights: str = "auto"):
    rules = rules_for(mesh)
    dtype = jnp.dtype(dtype or default_dtype())
    if path is None:
        from mtp_jax.default_model import default_gguf_path

        path = default_gguf_path()
    if os.path.isdir(path) and is_converted(path):
        from transformers import AutoTokenizer

        tokenizer = None
        if any(f.startswith("tokenizer") for f in os.listdir(path)):
            tokenizer = AutoTokenizer.from_pretrained(path)
        return _restore_converted(path, dtype, rules), tokenizer
    from checkpoints_convert.convert import config_of, nest
    from checkpoints_convert.source import open_source

    source = open_source(path)
    cfg = config_of(source)
    params = read_params(source, cfg, dtype, rules, keep_fp8=weights in ("auto", "fp8"))
    return assemble(cfg, nest(params), dtype, rules), source.load_tokenizer()


def read_params(
    source, cfg: ModelConfig, dtype, rules: ShardingRules | None, only_mtp: bool = False, keep_fp8: bool = False
) -> dict:
    """Every parameter of a checkpoint source, by path, one at a time: on the default device without `rules`;
    with them, each process reads only the blocks its devices hold and places them straight into their sharding.
    `keep_fp8`: weights the checkpoint stores as fp8 with block scales stay so (`QuantizedArray`: the values and
    their scales, each laid out as the weight), else they are dequantized into `dtype`."""
    from checkpoints_convert.convert import param_readers

    readers, _ = param_readers(source, cfg, dtype, only_mtp)

    def read(path, reader, part):
        shape = reader.part_shape(part)
        if rules is None:
            return jnp.asarray(reader.read(part=part))
        names = list(path) if part == "dense" else [*path, part]
        return place(shape, rules.param_sharding(names, shape), functools.partial(reader.read_blocks, part=part))

    params = {}
    for path, reader in readers.items():
        if keep_fp8 and reader.fp8_blocks is not None:
            params[path] = QuantizedArray(read(path, reader, "values"), read(path, reader, "scales"), jnp.dtype(dtype))
        else:
            params[path] = read(path, reader, "dense")
    return params


def load_model(
    path: str | None = None,
    *,
    dtype=None,
    mesh: Mesh | ShardingRules | None = None,
    head: str | None = None,
    default_head: bool = True,
    weights: str = "auto",
) -> CausalLM:
    """The model at `path` (converted folder, Hugging Face folder or .gguf); None means the default model.
    `mesh`, `head`, `default_head`, `weights`: as `load` takes them."""
    return load(path, dtype=dtype, mesh=mesh, head=head, default_head=default_head, weights=weights)[0]
