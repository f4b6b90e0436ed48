"""`load_model`: a converted folder, a Hugging Face folder or a .gguf (or the default model) -> `CausalLM`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.models.causal_lm import CausalLM


def default_dtype():
    """float32 on CPU (XLA's CPU bf16 matmuls are slow), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


CONFIG_FILE = "mtp_jax_config.json"  # marks a converted folder (checkpoints_convert writes it)


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def assemble(cfg: ModelConfig, params: dict, dtype) -> CausalLM:
    """A `CausalLM` whose parameters are `params` (nested dict of arrays in the model's state layout)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _restore_converted(path: str, dtype) -> CausalLM:
    import orbax.checkpoint as ocp

    from checkpoints_convert.convert import PARAMS_DIR, abstract_params, nest

    with open(os.path.join(path, CONFIG_FILE)) as f:
        cfg = ModelConfig.from_json(f.read())
    target = nest({p: jax.ShapeDtypeStruct(s.shape, dtype) for p, s in abstract_params(cfg, dtype).items()})
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)), target)
    return assemble(cfg, params, dtype)


def load(path: str | None = None, *, dtype=None, mesh=None, head: str | None = None):
    """(model, tokenizer or None) for `path`; None means the default model.

    `head`: a head folder written by `python -m mtp_jax.train_head`; by default the shipped head of the default
    model, or an `mtp_head/` folder inside the model folder, is attached when present.
    """
    from mtp_jax.heads import attach_head, head_for

    model, tokenizer = _load_trunk(path, dtype=dtype, mesh=mesh)
    head = head or head_for(path)
    return (attach_head(model, head) if head else model), tokenizer


def _load_trunk(path, *, dtype, mesh):
    if mesh is not None:
        raise NotImplementedError("loading onto a mesh is not supported yet; load without `mesh`")
    dtype = jnp.dtype(dtype or default_dtype())
    if path is None:
        from mtp_jax.default_model import default_gguf_path

        path = default_gguf_path()
    if os.path.isdir(path) and is_converted(path):
        from transformers import AutoTokenizer

        tokenizer = None
        if any(f.startswith("tokenizer") for f in os.listdir(path)):
            tokenizer = AutoTokenizer.from_pretrained(path)
        return _restore_converted(path, dtype), tokenizer
    from checkpoints_convert.convert import config_of, convert_params, nest
    from checkpoints_convert.source import open_source

    source = open_source(path)
    cfg = config_of(source)
    flat, _ = convert_params(source, cfg, dtype, place=lambda _, a: jnp.asarray(a))
    return assemble(cfg, nest(flat), dtype), source.load_tokenizer()


def load_model(path: str | None = None, *, dtype=None, mesh=None, head: str | None = None) -> CausalLM:
    """The model at `path` (converted folder, Hugging Face folder or .gguf); None means the default model."""
    return load(path, dtype=dtype, mesh=mesh, head=head)[0]
