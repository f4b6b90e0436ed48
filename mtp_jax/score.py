"""python -m mtp_jax.score: teacher-forced MTP quality on given text (no sampling).

For every position p, depth 1 predicts x[p+2] from the trunk hidden h[p] and the true x[p+1]. Depth i chains
exactly as a decode round does: step i runs at position p+i-1 from step i-1's hidden and the true x[p+i], attending
to depth-1 cache entries before p+1 and to its own chain's deeper entries after. A depth-i prediction is counted
as accepted when it equals the trunk's own argmax for the same token.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax import checkpoint
from mtp_jax.errors import UserError, exit_process, run_cli
from mtp_jax.files import write_atomically
from mtp_jax.hub import MODEL_HELP
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.prompts import bucket, encode_prompts, pad_batch, read_prompt_file


@functools.partial(jax.jit, static_argnames=("graphdef", "depth"))
def _teacher_forced(graphdef, params, tokens, depth: int):
    model: CausalLM = nnx.merge(graphdef, params)
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    cache = model.new_cache(batch, width + depth)
    hidden, _ = model.trunk(tokens, positions, cache)  # [B, T, D]
    trunk_argmax = jnp.argmax(model.logits(hidden), axis=-1)  # [B, T]: the trunk's x[p+1]
    padded = jnp.concatenate([tokens, jnp.zeros((batch, depth + 1), tokens.dtype)], axis=1)  # [B, T+d+1]
    mtp_cache = model.new_mtp_cache(batch, width + depth)
    deep, normed, mtp_cache = model.mtp_step(hidden, padded[:, 1 : width + 1], positions, mtp_cache)
    first = model.draft_ids(jnp.argmax(model.draft_logits(normed), axis=-1))  # [B, T]: predicts x[p+2]

    def chain(deep_p, start):  # deep_p [B, D]: depth-1 hidden at start position p
        chain_cache, predictions = mtp_cache, []
        for step in range(2, depth + 1):
            position = jnp.full((batch, 1), start + step - 1)
            true_token = jax.lax.dynamic_slice_in_dim(padded, start + step, 1, axis=1)  # [B, 1] x[p+step]
            deep_p, normed_p, chain_cache = model.mtp_step(deep_p[:, None], true_token, position, chain_cache)
            deep_p = deep_p[:, 0]
            predictions.append(model.draft_ids(jnp.argmax(model.draft_logits(normed_p[:, 0]), axis=-1)))
        return jnp.stack(predictions, axis=-1) if predictions else jnp.zeros((batch, 0), jnp.int32)

    deeper = jax.vmap(chain, in_axes=(1, 0), out_axes=1)(deep, jnp.arange(width))  # [B, T, d-1]
    return jnp.concatenate([first[..., None], deeper], axis=-1), trunk_argmax  # [B, T, d], [B, T]


def teacher_forced_predictions(model: CausalLM, tokens: np.ndarray, depth: int):
    """(MTP argmax [B, T, depth] predicting x[p+i+1] at depth i, trunk argmax [B, T] predicting x[p+1])."""
    graphdef, params = nnx.split(model)
    predictions, trunk = _teacher_forced(graphdef, params, jnp.asarray(tokens, jnp.int32), depth)
    return np.asarray(predictions), np.asarray(trunk)


def acceptance_counts(
    predictions: np.ndarray, trunk: np.ndarray, lengths: np.ndarray, starts: np.ndarray | None = None
) -> dict:
    """Per-depth agreement with the trunk's argmax: raw counts and counts given all shallower depths agreed.

    starts [B]: count only chains from slot starts - 1 on (a response starting at `starts`, where decoding's
    first round drafts from slot starts - 1); None counts every position.
    """
    _, width, depth = predictions.shape
    p = np.arange(width)
    first = np.zeros(len(lengths), int) if starts is None else np.maximum(np.asarray(starts) - 1, 0)
    agree_all = np.ones(predictions.shape[:2], bool)
    totals = {"judged": [], "agreed": [], "judged_chained": [], "agreed_chained": []}
    for i in range(depth):
        target_index = p + i + 1  # trunk prediction of x[p+i+2] sits at position p+i+1
        valid = (target_index[None, :] < lengths[:, None]) & (p[None, :] >= first[:, None])
        target = np.take_along_axis(trunk, np.minimum(target_index, width - 1)[None, :].repeat(len(trunk), 0), 1)
        agree = (predictions[..., i] == target) & valid
        totals["judged"].append(int(valid.sum()))
        totals["agreed"].append(int(agree.sum()))
        totals["judged_chained"].append(int((agree_all & valid).sum()))
        agree_all = agree_all & agree
        totals["agreed_chained"].append(int(agree_all.sum()))
    return totals


def summarize(totals: dict) -> dict:
    ratio = lambda a, b: [x / y if y else 0.0 for x, y in zip(a, b, strict=True)]
    chained = ratio(totals["agreed_chained"], totals["judged_chained"])
    expected, survive = 1.0, 1.0
    for rate in chained:
        survive *= rate
        expected += survive
    return {
        "acceptance_per_depth": ratio(totals["agreed"], totals["judged"]),
        "conditional_acceptance_per_depth": chained,
        "expected_accepted_length": expected,
        "positions_judged": totals["judged"],
    }


def scored_sequences(path: str, items: list[str | list[int]]) -> tuple[list[str | list[int]], list[int]]:
    """What to score for each line of a prompts file, and where counting starts. A JSONL line with "token_ids" (as
    `python -m mtp_jax.distill` and training data have them) is scored on those ids, from its "prompt_len" on when
    it has one: the response, as the trainer's eval counts it, not the prompt text beside it. Other lines: the text
    or ids as `read_prompt_file` gives them, every position."""
    starts = [0] * len(items)
    if not path.endswith(".jsonl"):
        return items, starts
    with open(path, encoding="utf-8") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]  # as read_prompt_file has them
    for i, (number, line) in enumerate(lines):
        record = json.loads(line)
        ids = record.get("token_ids") if isinstance(record, dict) else None
        if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            start = record.get("prompt_len", 0)
            if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(ids):
                raise UserError(f"{path}:{number}: prompt_len must be an integer in 0..{len(ids) - 1}")
            items[i], starts[i] = ids, start
    return items, starts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.score", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"{MODEL_HELP} (default: the default model)")
    parser.add_argument("--head", help="MTP head folder from train_head")
    parser.add_argument("--prompts-file", required=True)
    parser.add_argument("--num-draft", type=int, required=True)
    parser.add_argument("--out")
    parser.add_argument("--chat", action="store_true", help="wrap each text as a user turn of the chat template")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    return run_cli(run, args)


def run(args) -> int:

    if args.num_draft < 1:
        raise UserError(f"--num-draft must be >= 1, got {args.num_draft}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    items, starts = scored_sequences(args.prompts_file, read_prompt_file(args.prompts_file))
    model, tokenizer = checkpoint.load(args.model, dtype=args.dtype, head=args.head)
    if not model.config.has_mtp:
        raise UserError("this model has no MTP head to score")
    prompts = encode_prompts(
        items, tokenizer, chat=args.chat, vocab_size=model.config.vocab_size,
        context=model.config.max_position_embeddings,
    )  # fmt: skip
    totals, draft_argmax = None, []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        ids, lens = pad_batch(batch, len(batch), bucket(max(len(p.token_ids) for p in batch)))
        predictions, trunk = teacher_forced_predictions(model, ids, args.num_draft)
        counts = acceptance_counts(predictions, trunk, lens, np.asarray(starts[start : start + args.batch_size]))
        totals = (
            counts
            if totals is None
            else {k: [a + b for a, b in zip(totals[k], counts[k], strict=True)] for k in totals}
        )
        draft_argmax += [predictions[row, : max(lens[row] - 1, 0), 0].tolist() for row in range(len(batch))]
    result = {"num_draft": args.num_draft, "sequences": len(prompts), **summarize(totals)}
    result["draft_argmax"] = draft_argmax
    text = json.dumps(result) + "\n"
    if args.out:
        write_atomically(args.out, text)
    else:
        sys.stdout.write(text)
    per_depth = ", ".join(f"{x:.3f}" for x in result["conditional_acceptance_per_depth"])
    print(
        f"teacher-forced acceptance over {len(prompts)} sequence(s): per depth (given shallower) [{per_depth}], "
        f"expected accepted length {result['expected_accepted_length']:.2f}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    exit_process(main())
