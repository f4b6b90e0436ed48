"""Helpers shared by the parity tests against transformers' PyTorch models (test_parity.py, test_moe_parity.py,
test_hybrid_parity.py; torch tensors to numpy and random inputs also for test_gated_deltanet.py and
test_hybrid_blocks.py): loading a saved tiny checkpoint, block by block, full logits, greedy tokens."""

from __future__ import annotations

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import mtp_jax


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's values as a numpy array (same shape and dtype), detached from autograd."""
    return t.detach().numpy()


def state_dict_numpy(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter and buffer of a torch module as numpy arrays, by their state_dict names (torch's shapes)."""
    return {name: to_numpy(t) for name, t in module.state_dict().items()}


def normal_inputs(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 inputs ~ N(0, 1) of `shape` (e.g. [B, T, D]) from numpy's generator seeded `seed`, as a torch tensor."""
    return torch.from_numpy(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def save_and_load(hf: torch.nn.Module, folder: pathlib.Path) -> tuple[mtp_jax.CausalLM, dict]:
    """(our float32 model loaded from `folder`, the config.json dict) after transformers saves `hf` there."""
    hf.save_pretrained(folder, safe_serialization=True)
    with open(folder / "config.json") as f:
        saved = json.load(f)
    return mtp_jax.load_model(str(folder), dtype=jnp.float32), saved


def decoder_layer(model: mtp_jax.CausalLM, index: int, batch: int, slots: int) -> tuple[nnx.Module, list]:
    """(our trunk's decoder layer `index`, counted across segments; its zero cache arrays for `batch` rows and `slots`
    slots: keys and values [B, S, K, H] (GQA) or the latent [B, S, C] (MLA))."""
    for segment in model.segments:
        if index < segment.num_layers:
            graphdef, stacked = nnx.split(segment.layers)  # every leaf of `stacked`: [L, ...]
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=index: a[i], stacked))
            past = [leaf[index] for leaf in jax.tree.leaves(segment.new_cache(batch, slots, jnp.float32))]
            return layer, past
        index -= segment.num_layers
    raise IndexError(index)


def capture_blocks(hf: torch.nn.Module, ids: np.ndarray, attention: bool) -> tuple[dict, torch.Tensor]:
    """transformers' forward pass over ids [B, T], with hooks recording the embedding, rotary tables, every layer's
    input/output (keys "layer_in", "layer_out": {index: [B, T, D]}) and the final norm's ("norm_in", "norm_out"),
    with `attention` also every attention block's ("attn_in", "attn_out"); returns (what they recorded, the logits
    [B, T, V]). The hooks are removed afterwards."""
    seen: dict = {"layer_in": {}, "layer_out": {}, "attn_in": {}, "attn_out": {}}
    inner = hf.model
    handles = [
        inner.embed_tokens.register_forward_hook(lambda m, a, out: seen.__setitem__("embed", out)),
        inner.rotary_emb.register_forward_hook(lambda m, a, out: seen.__setitem__("rope", out)),
        inner.norm.register_forward_hook(lambda m, a, out: seen.update(norm_in=a[0], norm_out=out)),
    ]
    for i, layer in enumerate(inner.layers):
        handles += [
            layer.register_forward_pre_hook(lambda m, a, i=i: seen["layer_in"].__setitem__(i, a[0])),
            layer.register_forward_hook(lambda m, a, out, i=i: seen["layer_out"].__setitem__(i, out)),
        ]
        if attention:
            handles += [
                layer.self_attn.register_forward_pre_hook(
                    lambda m, a, kw, i=i: seen["attn_in"].__setitem__(i, kw["hidden_states"]), with_kwargs=True
                ),
                layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen["attn_out"].__setitem__(i, out[0])),
            ]
    try:
        with torch.no_grad():
            logits = hf(torch.from_numpy(ids).long()).logits
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def check_block_by_block(hf: torch.nn.Module, model: mtp_jax.CausalLM, ids: np.ndarray, tol: dict) -> None:
    """Each stage of ours fed transformers' own input over ids [B, T] (positions 0 .. T-1, zero caches of T slots):
    embedding, rotary tables, every layer, final norm, lm_head; with MLA, every attention block both absorbed and
    expanded. Each against transformers' output within `tol` (chex's atol / rtol)."""
    seen, logits = capture_blocks(hf, ids, attention=model.config.mla is not None)
    batch, length = ids.shape
    positions = jnp.broadcast_to(jnp.arange(length), ids.shape)  # [B, T]
    rope = model.rope(positions)
    chex.assert_trees_all_close(model.embed_tokens(ids), to_numpy(seen["embed"]), **tol)
    reference_rope = tuple(to_numpy(t) for t in seen["rope"])  # cos, sin: [1, T, H]
    chex.assert_trees_all_close(tuple(a[:1] for a in rope), reference_rope, **tol)
    for i in range(model.config.num_layers):
        layer, past = decoder_layer(model, i, batch, length)
        out, *_ = layer(to_numpy(seen["layer_in"][i]), positions, rope, *past)
        chex.assert_trees_all_close(out, to_numpy(seen["layer_out"][i]), **tol, custom_message=f"layer {i}")
        if model.config.mla is not None:
            for absorb in (True, False):
                attn, _ = layer.attn(to_numpy(seen["attn_in"][i]), positions, rope, *past, absorb=absorb)
                message = f"absorb={absorb}"
                chex.assert_trees_all_close(attn, to_numpy(seen["attn_out"][i]), **tol, custom_message=message)
    chex.assert_trees_all_close(model.final_norm(to_numpy(seen["norm_in"])), to_numpy(seen["norm_out"]), **tol)
    chex.assert_trees_all_close(model.logits(to_numpy(seen["norm_out"])), to_numpy(logits), **tol)


def check_full_logits(hf: torch.nn.Module, model: mtp_jax.CausalLM, ids: np.ndarray, tol: dict) -> None:
    """Our logits [B, T, V] over ids [B, T] (one pass into an empty cache of T slots) against transformers'."""
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)  # [B, T]
    hidden, _ = model.trunk(ids, positions, model.new_cache(*ids.shape))
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids).long()).logits
    chex.assert_trees_all_close(model.logits(hidden), to_numpy(reference), **tol)


def hf_greedy(hf: torch.nn.Module, prompt: np.ndarray, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt [T] alone: exactly `new_tokens` tokens (no EOS stops it)."""
    with torch.no_grad():
        out = hf.generate(
            torch.from_numpy(prompt).long()[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def check_greedy_batch(
    model: mtp_jax.CausalLM, ids: np.ndarray, lens: tuple[int, ...], references: list[list[int]], new_tokens: int
) -> None:
    """Our plain greedy decode of right-padded prompts ids [B, W] (row b's first lens[b] tokens) in one batch: every
    row runs the full `new_tokens` and gives references[b] (transformers' tokens for that prompt alone)."""
    cfg = mtp_jax.DecodeConfig(num_draft=0, max_new_tokens=new_tokens)
    batch = mtp_jax.generate(model, ids, np.asarray(lens), jax.random.key(0), cfg)
    assert np.asarray(batch.lengths).tolist() == [new_tokens] * len(lens)
    for row, reference in enumerate(references):
        assert np.asarray(batch.tokens[row]).tolist() == reference, f"row {row}"
