"""python -m mtp_jax.score: teacher-forced MTP quality on given text: how often the head's argmax drafts are
accepted (training/acceptance.py), and the acceptance of drafts sampled at T = 1 (training/head_refresh.py)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from mtp_jax.decode.prompts import bucket, encode_prompts, pad_batch, read_prompt_file
from mtp_jax.loading import checkpoint
from mtp_jax.loading.hub import MODEL_HELP
from mtp_jax.runtime.errors import UserError, run_cli
from mtp_jax.runtime.files import write_atomically
from mtp_jax.training.acceptance import acceptance_counts, summarize, teacher_forced_predictions
from mtp_jax.training.head_refresh import draft_agreement, rollout_batch


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
    sampled = np.zeros((2, args.num_draft))  # T = 1: expected acceptance summed over positions; positions
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        ids, lens = pad_batch(batch, len(batch), bucket(max(len(p.token_ids) for p in batch)))
        batch_starts = np.asarray(starts[start : start + args.batch_size])
        predictions, trunk = teacher_forced_predictions(model, ids, args.num_draft)
        counts = acceptance_counts(predictions, trunk, lens, batch_starts)
        totals = (
            counts
            if totals is None
            else {k: [a + b for a, b in zip(totals[k], counts[k], strict=True)] for k in totals}
        )
        draft_argmax += [predictions[row, : max(lens[row] - 1, 0), 0].tolist() for row in range(len(batch))]
        agreement = draft_agreement(model, rollout_batch(model, ids, lens, batch_starts), args.num_draft)
        sampled += np.asarray([agreement["expected"], [1.0] * args.num_draft]) * agreement["positions"]
    result = {"num_draft": args.num_draft, "sequences": len(prompts), **summarize(totals)}
    result["expected_acceptance_t1_per_depth"] = (sampled[0] / np.maximum(sampled[1], 1)).tolist()
    result["draft_argmax"] = draft_argmax
    text = json.dumps(result) + "\n"
    if args.out:
        write_atomically(args.out, text)
    else:
        sys.stdout.write(text)
    per_depth = ", ".join(f"{x:.3f}" for x in result["conditional_acceptance_per_depth"])
    print(
        f"teacher-forced acceptance over {len(prompts)} sequence(s): per depth (given shallower) [{per_depth}], "
        f"expected accepted length {result['expected_accepted_length']:.2f}; sampling at T = 1, each depth on the "
        f"text: [{', '.join(f'{x:.3f}' for x in result['expected_acceptance_t1_per_depth'])}]",
        file=sys.stderr,
    )
    return 0
