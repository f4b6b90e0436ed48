"""The model's parameter tree without the model: every parameter's path, shape and dtype (`abstract_params`), a
flat {path: value} map nested into the state layout (`nest`), a model assembled from such a tree (`assemble`), and
the file names of a converted folder."""

from __future__ import annotations

import jax
from flax import nnx

from mtp_jax.config.model import ModelConfig
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.parallel.sharding import ShardingRules

CONFIG_FILE = "mtp_jax_config.json"  # marks a converted folder: the model's ModelConfig
PARAMS_DIR = "params"  # the orbax checkpoint of the parameters
REPORT_FILE = "conversion.json"  # which tensors were used and which ignored, and why

ParamPath = tuple[str, ...]


def abstract_params(cfg: ModelConfig, dtype) -> dict[ParamPath, jax.ShapeDtypeStruct]:
    """Every parameter of the model for `cfg`, by path, without allocating it."""
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype))
    return {
        tuple(str(p) for p in path): jax.ShapeDtypeStruct(v.shape, v.dtype)
        for path, v in nnx.to_flat_state(nnx.state(model))
    }


def nest(flat: dict[ParamPath, object]) -> dict:
    """{('a', 'b'): x} -> {'a': {'b': x}}."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def assemble(cfg: ModelConfig, params: dict, dtype, rules: ShardingRules | None = None) -> CausalLM:
    """A `CausalLM` whose parameters are `params` (nested dict of arrays in the model's state layout); `rules`: the
    sharding rules they were placed with, kept on the model so `generate` lays out caches and activations to match."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype)))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    model.sharding_rules = rules
    return model
