"""tunix's trunks (its Llama3, Qwen2 and Qwen3 nnx models, Qwen3 dense or routed) as this project's `CausalLM`: the
config, and the parameters mapped on device (one stack per weight kind; no host copy of the model).

Both sides hold projections in the same einsum layouts (q [D, N, H], k/v [D, K, H], o [N, H, D], MLP kernels
[in, out], the embedding [V, D], an untied lm_head [D, V]); this project stacks a segment's layers on a leading axis,
and holds qkv biases as [N, H] where tunix holds [N * H].

Rotary embeddings: tunix 0.1.7's Llama3 and Qwen3 attentions call `apply_rope` without the config's `rope_theta`,
so their forward uses that function's default base, 1e6, whatever the config says (Qwen2 passes its own). The
mapped model takes the base tunix's forward uses (`forward_rope_theta`), so that it decodes the policy tunix trains;
tests/rl/test_tunix_models.py holds the two forwards equal on configs whose `rope_theta` is not 1e6.

tunix's Qwen3 with `num_experts` set is routed (Qwen3-30B-A3B's form): a `MoELayer` in every layer in place of the
MLP, mapped onto this project's `qwen3_moe` family (softmax-routed experts, models/softmax_moe.py). The layouts are
the same: router kernel [D, E], experts gate and up [E, D, F], down [E, F, D] (F: tunix's `hidden_dim`). tunix's
routing is transformers' Qwen3-MoE with `norm_topk_prob` true (tunix's config has no such switch): softmax over the
router logits (float32), the top `num_experts_per_tok`, always renormalised to sum 1; the mapped model routes so.

LoRA: a policy tunix trains through qwix holds, next to each adapted weight W, adapters `<name>_lora_a` A and
`<name>_lora_b` B (`nnx.LoRAParam`); qwix's forward adds (x A) B * alpha / rank to x W. The mapped model holds each
such weight merged, W + (A B) * alpha / rank (`merged_weight`), so that it decodes what qwix's forward computes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from mtp_jax.config.model import ModelConfig
from mtp_jax.families.registry import model_config_from_hf
from mtp_jax.loading.heads import trunk_fingerprint
from mtp_jax.models.causal_lm import CausalLM, model_param_axes
from mtp_jax.parallel.sharding import MESH_AXES, ShardingRules
from mtp_jax.params.tree import abstract_params, assemble, nest
from mtp_jax.runtime.errors import UserError


@dataclasses.dataclass(frozen=True)
class TunixFamily:
    model_type: str  # this project's family (a Hugging Face model_type)
    tied_field: str  # the tunix config's tied-embedding flag
    forward_ignores_rope_theta: bool


FAMILIES = {
    "Llama3": TunixFamily("llama", "weight_tying", forward_ignores_rope_theta=True),
    "Qwen2": TunixFamily("qwen2", "use_tied_embedding", forward_ignores_rope_theta=False),
    "Qwen3": TunixFamily("qwen3", "use_tied_embedding", forward_ignores_rope_theta=True),
}


# the weights of tunix's models whose LoRA adapters the mapped model merges (dotted paths in the model): not a routed
# Qwen3's experts (qwix adapts modules, and the experts are parameters of the MoELayer; its router is a module)
LORA_TARGETS = re.compile(r"layers\.\d+\.(attn\.[qkvo]_proj\.w|mlp\.(gate|up|down)_proj\.kernel|mlp\.router\.kernel)"
                          r"|lm_head\.w")  # fmt: skip


def tunix_class(model: nnx.Module) -> type:
    """tunix's own class of `model`: its type, or the tunix model class it derives from (qwix's LoRA wraps a model
    in a subclass of its own)."""
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES and cls.__module__.startswith("tunix.models."):
            return cls
    raise UserError(f"a tunix {type(model).__name__} model cannot be mapped: only tunix's {', '.join(FAMILIES)} are")


def tunix_family(model: nnx.Module) -> TunixFamily:
    return FAMILIES[tunix_class(model).__name__]


def forward_rope_theta(model: nnx.Module) -> float:
    """The rotary base the forward of a tunix model whose attention calls its module's `apply_rope` without one
    uses: that function's default, or the `rope_theta` of a `functools.partial` put in its place (how to run such a
    model at its checkpoint's base: `tunix.models.llama3.model.apply_rope = functools.partial(apply_rope,
    rope_theta=...)`)."""
    rope = sys.modules[tunix_class(model).__module__].apply_rope
    if isinstance(rope, functools.partial) and "rope_theta" in rope.keywords:
        return float(rope.keywords["rope_theta"])
    return float(inspect.signature(rope).parameters["rope_theta"].default)


def trunk_config(model: nnx.Module, eos_token_ids: tuple[int, ...], context: int) -> ModelConfig:
    """This project's config of tunix `model`'s trunk (no MTP layer), stopping at `eos_token_ids`, holding
    `context` positions."""
    family, cfg = tunix_family(model), model.config
    rope_theta = forward_rope_theta(model) if family.forward_ignores_rope_theta else float(cfg.rope_theta)
    hf = {
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": float(cfg.norm_eps),
        "rope_theta": rope_theta,
        "tie_word_embeddings": bool(getattr(cfg, family.tied_field)),
        "max_position_embeddings": context,
        "eos_token_id": list(eos_token_ids),
        "hidden_act": "silu",
    }
    if family.model_type == "qwen2":
        hf["attention_bias"] = True
    if getattr(cfg, "num_experts", None):
        hf.update(routed_fields(cfg))
    return model_config_from_hf(hf)


def routed_fields(cfg) -> dict:
    """The Hugging Face fields of tunix's routed Qwen3 config `cfg`: every layer routed, each expert of width
    `hidden_dim`, the picked probabilities renormalised (tunix's MoELayer always does)."""
    picks = cfg.num_experts_per_tok
    if not isinstance(picks, int) or not 1 <= picks <= cfg.num_experts:
        raise UserError(f"tunix's routed Qwen3 needs num_experts_per_tok in 1..{cfg.num_experts}, got {picks!r}")
    return {"model_type": "qwen3_moe", "num_experts": cfg.num_experts, "num_experts_per_tok": picks,
            "moe_intermediate_size": cfg.hidden_dim, "norm_topk_prob": True}  # fmt: skip


def trunk_params(model: nnx.Module, cfg: ModelConfig, dtype,
                 lora_alpha: float | None = None) -> dict[tuple[str, ...], jax.Array]:  # fmt: skip
    """tunix `model`'s parameters at this project's paths for `cfg` (`trunk_config`), in `dtype`, LoRA adapters
    merged with `lora_alpha` (the alpha of the qwix LoraProvider that made them; needed when there are any): jax
    arrays made on the devices that hold tunix's (traceable: no host transfer)."""
    tunix_family(model)
    adapted = lora_adapters(model)
    unmapped = [path for path in adapted if not LORA_TARGETS.fullmatch(path)]
    if unmapped:
        raise UserError(f"LoRA adapters on {', '.join(unmapped[:3])} are not merged: only those on the attention "
                        "and dense MLP projections, a routed Qwen3's router and the lm_head are")  # fmt: skip
    if adapted and lora_alpha is None:
        raise UserError("tunix's model holds LoRA adapters: give lora_alpha, the alpha of the qwix LoraProvider "
                        "that made them (each adapter is scaled by alpha / its rank)")  # fmt: skip
    layers = list(model.layers)
    n, h, k = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads

    def weight(module: nnx.Module, name: str) -> jax.Array:
        return merged_weight(module, name, lora_alpha).astype(dtype)

    def stacked(get, name: str, shape=None) -> jax.Array:
        arrays = [weight(get(layer), name) for layer in layers]
        return jnp.stack([a if shape is None else a.reshape(shape) for a in arrays])

    prefix = ("segments", "0", "layers")
    flat = {
        ("embed",): weight(model.embedder, "input_embedding"),
        ("final_norm", "scale"): weight(model.final_norm, "w"),
        (*prefix, "input_norm", "scale"): stacked(lambda layer: layer.input_layernorm, "w"),
        (*prefix, "post_attention_norm", "scale"): stacked(lambda layer: layer.post_attention_layernorm, "w"),
        (*prefix, "attn", "q_proj"): stacked(lambda layer: layer.attn.q_proj, "w"),
        (*prefix, "attn", "k_proj"): stacked(lambda layer: layer.attn.k_proj, "w"),
        (*prefix, "attn", "v_proj"): stacked(lambda layer: layer.attn.v_proj, "w"),
        (*prefix, "attn", "o_proj"): stacked(lambda layer: layer.attn.o_proj, "w"),
    }
    if cfg.moe is None:  # [L, D, F], [L, D, F], [L, F, D]
        flat[(*prefix, "mlp", "gate_proj")] = stacked(lambda layer: layer.mlp.gate_proj, "kernel")
        flat[(*prefix, "mlp", "up_proj")] = stacked(lambda layer: layer.mlp.up_proj, "kernel")
        flat[(*prefix, "mlp", "down_proj")] = stacked(lambda layer: layer.mlp.down_proj, "kernel")
    else:  # the router [L, D, E]; the experts [L, E, D, F], [L, E, D, F], [L, E, F, D]
        flat[(*prefix, "mlp", "router")] = stacked(lambda layer: layer.mlp.router, "kernel")
        for ours, theirs in (("expert_gate", "gate_proj"), ("expert_up", "up_proj"), ("expert_down", "down_proj")):
            flat[(*prefix, "mlp", ours)] = stacked(lambda layer: layer.mlp, theirs)
    if not cfg.tie_word_embeddings:
        flat[("lm_head",)] = weight(model.lm_head, "w")
    if cfg.qkv_bias:
        flat[(*prefix, "attn", "q_bias")] = stacked(lambda layer: layer.attn, "q_bias", (n, h))
        flat[(*prefix, "attn", "k_bias")] = stacked(lambda layer: layer.attn, "k_bias", (k, h))
        flat[(*prefix, "attn", "v_bias")] = stacked(lambda layer: layer.attn, "v_bias", (k, h))
    if cfg.qk_norm:
        flat[(*prefix, "attn", "q_norm", "scale")] = stacked(lambda layer: layer.attn.q_norm, "w")
        flat[(*prefix, "attn", "k_norm", "scale")] = stacked(lambda layer: layer.attn.k_norm, "w")
    return flat


def lora_adapters(model: nnx.Module) -> list[str]:
    """The dotted paths of tunix `model`'s weights that hold a qwix LoRA adapter (none without LoRA)."""
    paths = (".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    return sorted({path.rsplit("_lora_", 1)[0] for path in paths})


def merged_weight(module: nnx.Module, name: str, lora_alpha: float | None) -> jax.Array:
    """`module`'s weight `name` W, with its qwix LoRA adapter merged in when it has one: W + (A B) * alpha / rank.
    qwix makes A [the dims of W the input contracts, rank] and B [rank, W's other dims] (for a dot_general weight
    each side flattened to one dim); tunix's projections lead with the contracted dims (q/k/v [D, N, H], o
    [N, H, D], MLP [in, out], lm_head [D, V]), so A [C, rank] @ B [rank, O] reshaped is in W's layout."""
    w = getattr(module, name)[...]
    lora_a, lora_b = getattr(module, f"{name}_lora_a", None), getattr(module, f"{name}_lora_b", None)
    if lora_a is None or lora_b is None:
        return w
    return lora_merged(w, lora_a[...], lora_b[...], scale=lora_alpha / lora_a.shape[-1])


@functools.partial(jax.jit, static_argnames="scale")
def lora_merged(w: jax.Array, lora_a: jax.Array, lora_b: jax.Array, scale: float) -> jax.Array:
    """W + (A B) * `scale` in float32 at full matmul precision, A [C..., r] and B [r, O...] flattened to [C, r] and
    [r, O], their product reshaped to W's [C..., O...]. Compiled, so that the scale is no host transfer (tunix syncs
    weights where none is allowed)."""
    rank = lora_a.shape[-1]
    a = lora_a.reshape(-1, rank).astype(jnp.float32)  # [C, r]
    b = lora_b.reshape(rank, -1).astype(jnp.float32)  # [r, O]
    delta = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)  # [C..., O...]
    return w.astype(jnp.float32) + delta * scale


def causal_lm_from_tunix(model: nnx.Module, eos_token_ids: tuple[int, ...], context: int, dtype=jnp.float32,
                         head: CausalLM | None = None, mesh: jax.sharding.Mesh | None = None,
                         lora_alpha: float | None = None) -> CausalLM:  # fmt: skip
    """tunix `model`'s trunk as a `CausalLM` in `dtype` (LoRA adapters merged with `lora_alpha`: `trunk_params`),
    with the MTP head (and draft vocabulary) of `head`, a `CausalLM` of the same trunk shape, when given; laid out
    on `mesh` by `rollout_rules`, or without one (or on a one-device mesh) on the device holding tunix's
    embedding."""
    cfg = trunk_config(model, eos_token_ids, context)
    flat = trunk_params(model, cfg, dtype, lora_alpha)
    if head is not None:
        if trunk_fingerprint(head.config) != trunk_fingerprint(cfg):
            theirs, ours = trunk_fingerprint(head.config), trunk_fingerprint(cfg)
            raise UserError(f"the MTP head was made for the trunk {theirs}, not tunix's {ours}")
        cfg = cfg.replace(mtp=head.config.mtp)
        own = {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(head))}
        flat.update({path: own[path] for path in abstract_params(cfg, dtype) if path not in flat})
    missing = sorted(".".join(p) for p in abstract_params(cfg, dtype) if p not in flat)
    if missing:
        raise UserError(f"the mapped tunix model lacks {', '.join(missing[:3])}")
    rules = rollout_rules(mesh)
    if rules is None:  # onto the device holding tunix's embedding (a bare device would keep a mesh's axis types)
        device = jax.sharding.SingleDeviceSharding(next(iter(flat[("embed",)].devices())))
        flat = {path: jax.device_put(value, device) for path, value in flat.items()}
    else:  # each parameter in its logical axes' sharding over tunix's devices, resharded on them (no host copy)
        axes = model_param_axes(cfg, dtype)
        shardings = {path: rules.sharding(axes[path], value.shape) for path, value in flat.items()}
        flat = jax.jit(lambda tree: tree, out_shardings=shardings)(flat)
    return assemble(cfg, nest(flat), dtype, rules)


def rollout_rules(mesh: jax.sharding.Mesh | None) -> ShardingRules | None:
    """This project's sharding rules over a tunix mesh's devices (None on one device): its tensor-parallel axis
    ("tp", or "model") becomes `model` (heads, MLP, vocabulary), its other axes together `data` (the slots' rows),
    on a mesh of this project's axes (data, expert = 1, model) over the same devices."""
    if mesh is None or mesh.size == 1:
        return None
    tensor = next((a for a in ("tp", "model") if a in mesh.axis_names), None)
    rows = [a for a in mesh.axis_names if a != tensor]
    order = [mesh.axis_names.index(a) for a in (*rows, *([tensor] if tensor else []))]
    devices = np.transpose(mesh.devices, order).reshape(-1, 1, mesh.shape[tensor] if tensor else 1)
    return ShardingRules(Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES)))
