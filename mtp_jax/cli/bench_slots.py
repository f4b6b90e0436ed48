"""`python -m mtp_jax.bench --refill`: many prompts through slots that refill vs through static batches, side by
side in one process, on the same rows, prompts and settings.

A static batch decodes until its longest answer ends, its finished rows idle; slots (decode/engine.py) hand a
finished row's slot to the next prompt at once. Both run `decode_batches` of `python -m mtp_jax.decode --prompts-file`
(the static one with its refill off), greedy, answers ending at EOS, so each prompt's tokens are compared too.
Compile time is timed apart from the decode's (by JAX's own clocks, `compile_cache.compile_seconds`).
"""

from __future__ import annotations

import json
import sys

from mtp_jax.bench.environment import header_lines, metadata
from mtp_jax.cli.invariance import EVAL_PROMPTS
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.prompts import Prompt, encode_prompts
from mtp_jax.decode.text import decode_batches, row_sampling
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.runtime.errors import UserError


def held_out_prompts(model: CausalLM, tokenizer, count: int) -> list[Prompt]:
    """The held-out prompts (mtp_jax/data/eval_prompts.jsonl: chat, code, math, summaries), cycled to `count`,
    through the chat template."""
    with open(EVAL_PROMPTS) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    items = [texts[i % len(texts)] for i in range(count)]
    cfg = model.config
    return encode_prompts(items, tokenizer, chat=True, vocab_size=cfg.vocab_size, context=cfg.max_position_embeddings)


def decode_both(model: CausalLM, tokenizer, prompts: list[Prompt], cfg: DecodeConfig, rows: int) -> list[dict]:
    """A row of the table for static batches and one for slots, with these settings."""
    results, table = {}, []
    for refill in (False, True):
        answers = []
        summary = decode_batches(model, tokenizer, prompts, cfg, rows, row_sampling(cfg, 0), answers.extend,
                                 refill=refill)  # fmt: skip
        results[refill] = [a.token_ids for a in answers]
        table.append({
            "mode": "slots" if refill else "static batches",
            "rows": rows,
            "k": cfg.num_draft,
            "adaptive": cfg.adaptive,
            "prompts": len(prompts),
            "generated_tokens": summary["generated_tokens"],
            "tokens_per_second": summary["tokens_per_second"],
            "wall_seconds": summary["wall_seconds"],
            "compile_seconds": summary["compile_seconds"],
            "rounds": summary["rounds"],
            "mean_accepted_length": summary["mean_accepted_length"],
        })  # fmt: skip
        print(f"{table[-1]['mode']}: {rows} rows, k={cfg.num_draft}: {summary['tokens_per_second']:.1f} tokens/s "
              f"({summary['generated_tokens']} tokens)", file=sys.stderr, flush=True)  # fmt: skip
    same = sum(a == b for a, b in zip(results[False], results[True], strict=True))
    static, slots = table
    slots["same_tokens"] = f"{same}/{len(prompts)}"
    slots["speedup_vs_static"] = slots["tokens_per_second"] / static["tokens_per_second"]
    return table


def run_refill(args, model: CausalLM, tokenizer, label: str, dtype: str, notes: list[str]) -> dict:
    """The comparison for every --batch-sizes (rows) and --num-draft (k; --adaptive adds adaptive rows)."""
    if tokenizer is None:
        raise UserError("--refill decodes the held-out text prompts: it needs a model with a tokenizer")
    prompts = held_out_prompts(model, tokenizer, args.prompts)
    drafts = sorted({0, *args.num_draft}) if model.config.has_mtp else [0]
    settings = [DecodeConfig(num_draft=k, max_new_tokens=args.max_new_tokens, invariant=args.invariant)
                for k in drafts]  # fmt: skip
    if args.adaptive and model.config.has_mtp:
        settings.append(DecodeConfig(num_draft=max(drafts), max_new_tokens=args.max_new_tokens, adaptive=True,
                                     invariant=args.invariant))  # fmt: skip
    rows = [row for batch in args.batch_sizes for cfg in settings for row in decode_both(model, tokenizer, prompts,
                                                                                         cfg, batch)]  # fmt: skip
    meta = metadata(args, label, dtype, notes, model)
    meta["prompts"] = f"{len(prompts)} held-out prompts (eval_prompts.jsonl, cycled)"
    return {"meta": meta, "rows": rows}


def refill_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        *header_lines(meta),
        f"- model: {meta['model']} ({meta['dtype']}); prompts: {meta['prompts']}; at most {meta['max_new_tokens']} "
        "new tokens per answer, ending at EOS; greedy",
        *(f"- note: {note}" for note in meta["notes"]),
        "",
        "| mode | rows | k | tokens/s | generated tokens | rounds | mean accepted len | wall s | compile s "
        "| slots/static | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        k = f"{r['k']} adaptive" if r["adaptive"] else str(r["k"])
        speedup = f"{r['speedup_vs_static']:.2f}x" if "speedup_vs_static" in r else "-"
        lines.append(
            f"| {r['mode']} | {r['rows']} | {k} | {r['tokens_per_second']:.1f} | {r['generated_tokens']} "
            f"| {r['rounds']} | {r['mean_accepted_length']:.2f} | {r['wall_seconds']:.1f} "
            f"| {r['compile_seconds']:.1f} | {speedup} | {r.get('same_tokens', '-')} |"
        )
    return "\n".join(lines) + "\n"
