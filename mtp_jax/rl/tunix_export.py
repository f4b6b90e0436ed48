"""A `CausalLM`'s dense trunk as tunix's own nnx model (Llama3, Qwen2, Qwen3), to train as an RL policy: the
inverse of rl/tunix_models.py's mapping, so a model this project loads (the default model, a checkpoint, a hub repo
id) can be fine-tuned by tunix while `MtpRollout` decodes it with its MTP head.

The weights must be held as floats (`mtp_jax.load(..., weights="bfloat16")`): tunix trains floats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen3 import model as qwen3

from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.rl.tunix_models import FAMILIES, forward_rope_theta
from mtp_jax.runtime.errors import UserError

TUNIX_CLASSES = {"llama": "Llama3", "qwen2": "Qwen2", "qwen3": "Qwen3"}
TUNIX_MODULES = {"llama": llama3, "qwen2": qwen2, "qwen3": qwen3}


def tunix_config(model: CausalLM):
    """tunix's ModelConfig for `model`'s trunk (a family tunix has, in the form tunix's model computes)."""
    cfg = model.config
    if cfg.family not in TUNIX_CLASSES or len(model.segments) != 1:
        raise UserError(f"tunix has no model of family {cfg.family!r}: only {', '.join(TUNIX_CLASSES)}")
    plain = (cfg.rope.kind == "default" and cfg.rope.partial_factor == 1.0 and not cfg.rope.interleaved
             and not cfg.mlp_bias and not (cfg.o_bias and cfg.family != "qwen2") and cfg.moe is None)  # fmt: skip
    if not plain or cfg.qkv_bias != (cfg.family == "qwen2") or cfg.qk_norm != (cfg.family == "qwen3"):
        raise UserError(f"this {cfg.family} trunk has parts tunix's {TUNIX_CLASSES[cfg.family]} does not compute "
                        "(rope scaling, partial rotary, biases or q/k norms it lacks)")  # fmt: skip
    shape = dict(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
                 hidden_dim=cfg.intermediate_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                 num_kv_heads=cfg.num_kv_heads, norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope.theta)  # fmt: skip
    if cfg.family == "llama":
        return llama3.ModelConfig(**shape, weight_tying=cfg.tie_word_embeddings)
    module = qwen2 if cfg.family == "qwen2" else qwen3
    return module.ModelConfig(**shape, use_tied_embedding=cfg.tie_word_embeddings)


def tunix_model_from_causal_lm(model: CausalLM) -> nnx.Module:
    """tunix's model of `model`'s trunk (no MTP head), holding copies of its weights in their dtype. A tunix model
    whose forward ignores the config's rotary base (Llama3, Qwen3 in tunix 0.1.7) must run at this model's base:
    otherwise this refuses, saying how to set it."""
    tcfg = tunix_config(model)
    cfg = model.config
    module = TUNIX_MODULES[cfg.family]
    cls = getattr(module, TUNIX_CLASSES[cfg.family])
    abstract = nnx.eval_shape(lambda: cls(tcfg, rngs=nnx.Rngs(0)))
    ignores = FAMILIES[cls.__name__].forward_ignores_rope_theta
    theirs, ours = forward_rope_theta(abstract) if ignores else cfg.rope.theta, cfg.rope.theta
    if theirs != ours:
        raise UserError(
            f"tunix's {cls.__name__} computes with rotary base {theirs:g}, this model {ours:g}: set "
            f"{module.__name__}.apply_rope = functools.partial(apply_rope, rope_theta={ours:g}) first"
        )
    state = nnx.state(abstract)
    nnx.replace_by_pure_dict(state, _tunix_params(model, abstract))
    nnx.update(abstract, state)
    return abstract


def _tunix_params(model: CausalLM, target: nnx.Module) -> dict:
    """The nested state dict of `target` (tunix's model, abstract) filled from `model`'s parameters."""
    cfg = model.config
    layers = model.segments[0].layers

    def value(variable) -> jax.Array:
        array = variable.get_value()
        if not isinstance(array, jax.Array) or not jnp.issubdtype(array.dtype, jnp.floating):
            raise UserError("the model's weights are quantized: load it with weights='bfloat16' to train it in tunix")
        return jnp.array(array)  # a copy: tunix trains it in place

    per_layer = {
        ("input_layernorm", "w"): value(layers.input_norm.scale),
        ("post_attention_layernorm", "w"): value(layers.post_attention_norm.scale),
        ("attn", "q_proj", "w"): value(layers.attn.q_proj),
        ("attn", "k_proj", "w"): value(layers.attn.k_proj),
        ("attn", "v_proj", "w"): value(layers.attn.v_proj),
        ("attn", "o_proj", "w"): value(layers.attn.o_proj),
        ("mlp", "gate_proj", "kernel"): value(layers.mlp.gate_proj),
        ("mlp", "up_proj", "kernel"): value(layers.mlp.up_proj),
        ("mlp", "down_proj", "kernel"): value(layers.mlp.down_proj),
    }
    if cfg.qkv_bias:
        for name in ("q_bias", "k_bias", "v_bias"):
            stacked = value(getattr(layers.attn, name))  # [L, N, H]
            per_layer[("attn", name)] = stacked.reshape(stacked.shape[0], -1)
    if cfg.qk_norm:
        per_layer[("attn", "q_norm", "w")] = value(layers.attn.q_norm.scale)
        per_layer[("attn", "k_norm", "w")] = value(layers.attn.k_norm.scale)
    state = nnx.to_pure_dict(nnx.state(target))
    state["embedder"]["input_embedding"] = value(model.embed)
    state["final_norm"]["w"] = value(model.final_norm.scale)
    if not cfg.tie_word_embeddings:
        state["lm_head"]["w"] = value(model.lm_head)
    for i in range(cfg.num_layers):
        for path, stacked in per_layer.items():
            node = state["layers"][i]
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = stacked[i]
    return state
