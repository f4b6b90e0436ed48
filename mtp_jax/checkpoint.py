"""`load_model`: a converted folder, a Hugging Face folder or a .gguf (or the default model) -> `CausalLM`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mtp_jax.config import ModelConfig
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.sharding import ShardingRules, place, rules_for


def default_dtype():
    """float32 on CPU (XLA's CPU bf16 matmuls are slow), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


CONFIG_FILE = "mtp_jax_config.json"  # marks a converted folder (checkpoints_convert writes it)


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


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

    with open(os.path.join(path, CONFIG_FILE)) as f:
        cfg = ModelConfig.from_json(f.read())

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
):
    """(model, tokenizer or None) for `path`; None means the default model.

    `mesh`: a `jax.sharding.Mesh` (default rules of `mtp_jax.sharding`) or `ShardingRules`; every parameter is then
    placed directly into its sharding, and each process reads only the parts of the tensors its devices hold.

    `head`: a head folder written by `python -m mtp_jax.train_head`; without one, the shipped head of the default
    model, or an `mtp_head/` folder inside the model folder, is attached when present (`default_head=False`: not;
    e.g. to train a new head on the bare trunk).
    """
    from mtp_jax.heads import attach_head, head_for

    model, tokenizer = _load_trunk(path, dtype=dtype, mesh=mesh)
    head = head or (head_for(path) if default_head else None)
    return (attach_head(model, head) if head else model), tokenizer


def _load_trunk(path, *, dtype, mesh):
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
    return assemble(cfg, nest(read_params(source, cfg, dtype, rules)), dtype, rules), source.load_tokenizer()


def read_params(source, cfg: ModelConfig, dtype, rules: ShardingRules | None, only_mtp: bool = False) -> dict:
    """Every parameter of a checkpoint source, by path, one at a time: on the default device without `rules`;
    with them, each process reads only the blocks its devices hold and places them straight into their sharding."""
    from checkpoints_convert.convert import param_readers

    readers, _ = param_readers(source, cfg, dtype, only_mtp)
    if rules is None:
        return {p: jnp.asarray(r.read()) for p, r in readers.items()}
    return {p: place(r.shape, rules.param_sharding(p, r.shape), r.read_blocks) for p, r in readers.items()}


def load_model(
    path: str | None = None,
    *,
    dtype=None,
    mesh: Mesh | ShardingRules | None = None,
    head: str | None = None,
    default_head: bool = True,
) -> CausalLM:
    """The model at `path` (converted folder, Hugging Face folder or .gguf); None means the default model.
    `mesh`, `head`, `default_head`: as `load` takes them."""
    return load(path, dtype=dtype, mesh=mesh, head=head, default_head=default_head)[0]
