"""Where a row's numbers depend on what shares its pass: each prompt's row computed alone and inside a batch of
prompts of other lengths, compared bit for bit after every stage of every layer.

    python -m mtp_jax.invariance [--model PATH] [--dtype bfloat16] [--no-invariant] [--prompts-file FILE]

Two passes are compared, each batch against the same rows alone: the prefill (right-padded to the batch's widest
prompt) and one decode step after it. For each pass the report lists, per stage (a layer's input norm, attention,
its residual sum, the MLP norm, the MLP, the layer's output; then the final norm and the logits), how many rows
differ from their alone run, and the first stage where each row moved. Batch-invariant numerics
(DecodeConfig.invariant, on here unless --no-invariant) should report no differing row anywhere; a row alone then
runs beside its twin, as `generate` runs a batch of one in that mode.

Trunks of layer stacks (GQA or latent attention, dense or routed-expert MLPs) are traced layer by layer; hybrid
trunks (gated DeltaNet groups) are compared at their outputs only (tests/ops/test_invariance.py checks their blocks).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.decode.prompts import encode_prompts, read_prompt_file
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.dispatch import lone_rows_exact
from mtp_jax.loading import checkpoint
from mtp_jax.loading.hub import MODEL_HELP
from mtp_jax.models.cache_attention import ATTENTION_CHUNK, AttentionForm, default_attention
from mtp_jax.models.causal_lm import CausalLM, LayerStack
from mtp_jax.ops import loops
from mtp_jax.runtime.errors import UserError, run_cli

EVAL_PROMPTS = pathlib.Path(__file__).resolve().parent.parent / "data" / "eval_prompts.jsonl"
LAYER_STAGES = ("input_norm", "attention", "residual", "mlp_norm", "mlp", "output")


def _layers(model: CausalLM) -> list:
    """Every trunk layer as a module of its own, in order."""
    layers = []
    for segment in model.segments:
        if not isinstance(segment, LayerStack):
            raise ValueError("layer-by-layer tracing covers trunks of layer stacks; this one has layer groups")
        stacked = segment.layers
        layers += (
            list(stacked) if isinstance(stacked, nnx.List) else loops.unstacked_modules(stacked, segment.num_layers)
        )
    return layers


def _empty_pasts(model: CausalLM, batch: int, slots: int, attention: str) -> list[list[jax.Array]]:
    """Every trunk layer's empty cache arrays, each [B, S, ...]."""
    pasts = []
    for segment in model.segments:
        leaves = jax.tree.leaves(segment.new_cache(batch, slots, model.dtype, attention))  # each [L, B, S, ...]
        pasts += [[leaf[i] for leaf in leaves] for i in range(segment.num_layers)]
    return pasts


def trace(model: CausalLM, ids, positions, pasts, attention: str):
    """Stages of a pass of tokens ids [B, T] at positions [B, T] over per-layer caches `pasts` (each a list of
    [B, S, ...] arrays): ({stage name: [B, T, ...]}, the caches with this pass's entries written)."""
    stages, x = {}, model.embed_tokens(ids)
    rope = model.rope(positions)
    written = []
    for i, (layer, past) in enumerate(zip(_layers(model), pasts, strict=True)):
        normed = layer.input_norm(x)
        attended, *new = layer.attn(normed, positions, rope, *past, attention=attention)
        residual = x + attended
        mlp_normed = layer.post_attention_norm(residual)
        mlp_out = layer.mlp(mlp_normed, invariant=attention == AttentionForm.INVARIANT)
        x = residual + mlp_out
        for name, value in zip(LAYER_STAGES, (normed, attended, residual, mlp_normed, mlp_out, x), strict=True):
            stages[f"layer {i} {name}"] = value
        written.append([_write(old, entry, positions) for old, entry in zip(past, new, strict=True)])
    stages["final_norm"] = model.final_norm(x)
    stages["logits"] = model.logits(stages["final_norm"])
    return stages, written


def _write(cache, entries, positions):
    """cache [B, S, ...] with entries [B, T, ...] at positions [B, T] of their rows."""
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, positions].set(entries.astype(cache.dtype))


@nnx.jit(static_argnames=("invariant", "slots"))
def _prefill_and_step(model, ids, lens, next_ids, invariant: bool, slots: int):
    """Stages of the prefill of right-padded ids [B, P] and of one step of next_ids [B] at positions lens [B]."""
    batch, width = ids.shape
    attention = AttentionForm.INVARIANT if invariant else default_attention(slots)
    pasts = _empty_pasts(model, batch, slots, attention)
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    with traced_plan.tracing(traced_plan.resolve(model.sharding_rules, invariant)):
        prefill, pasts = trace(model, ids, positions, pasts, attention)
        step, _ = trace(model, next_ids[:, None], lens[:, None], pasts, attention)
    return prefill, step


def compare(model: CausalLM, prompts: list[list[int]], invariant: bool) -> dict:
    """For the prefill and one step: per stage, the rows whose values differ from the row alone; and per row, the
    first stage where it moved (None: nowhere)."""
    width = max(len(p) for p in prompts)
    slots = -(-(width + 1) // ATTENTION_CHUNK) * ATTENTION_CHUNK
    ids = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    next_ids = ids[:, 0]  # any token: the step only has to be the same one batched and alone
    batched = _prefill_and_step(model, ids, lens, next_ids, invariant, slots)
    report = {"prefill": {}, "step": {}}
    first = {"prefill": [None] * len(prompts), "step": [None] * len(prompts)}
    order = [f"layer {i} {name}" for i in range(model.config.num_layers) for name in LAYER_STAGES]
    order += ["final_norm", "logits"]
    for row, p in enumerate(prompts):
        alone = ids[row : row + 1, : len(p)], lens[row : row + 1], next_ids[row : row + 1]
        if invariant and not lone_rows_exact():  # as generate runs a lone row: beside its twin
            alone = [np.concatenate([x, x]) for x in alone]
        alone = _prefill_and_step(model, *alone, invariant, slots)
        for pass_index, name in enumerate(("prefill", "step")):
            for stage in order:
                value = batched[pass_index][stage]
                got = np.asarray(value[row, : len(p)] if name == "prefill" else value[row])
                want = np.asarray(alone[pass_index][stage][0])
                if got.shape != want.shape or not np.array_equal(got, want):
                    report[name].setdefault(stage, []).append(row)
                    first[name][row] = first[name][row] or stage
    return {"differing_rows_by_stage": report, "first_differing_stage_by_row": first}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.invariance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"{MODEL_HELP} (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prompts-file", default=str(EVAL_PROMPTS), help="a prompt a line, .txt or .jsonl "
                        "(default: the held-out evaluation prompts)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args(argv)
    return run_cli(_run, args)


def _run(args) -> int:

    model, tokenizer = checkpoint.load(args.model, dtype=args.dtype)
    items = read_prompt_file(args.prompts_file)[: args.num_prompts]
    cfg = model.config
    encoded = encode_prompts(
        items, tokenizer, chat=True, vocab_size=cfg.vocab_size, context=cfg.max_position_embeddings
    )
    try:
        result = compare(model, [p.token_ids for p in encoded], args.invariant)
    except ValueError as e:
        raise UserError(str(e)) from None
    json.dump(result, sys.stdout, indent=1)
    print(file=sys.stdout)
    return 0
