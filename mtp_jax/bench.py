"""python -m mtp_jax.bench: plain vs MTP decoding (and transformers' PyTorch generate) — same model, same prompts,
one process. Compile time is measured apart; each configuration runs `--repeats` times and the median is kept.
Greedy MTP is lossless, so plain and MTP runs generate the same tokens: equal work, compared by wall time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from mtp_jax.errors import UserError, run_cli

EVAL_PROMPTS = os.path.join(os.path.dirname(__file__), "data", "eval_prompts.jsonl")


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model path (default: the default model)")
    parser.add_argument("--head", help="MTP head folder (default: the model's own or shipped head)")
    parser.add_argument("--prompts-file", default=EVAL_PROMPTS, help="default: the held-out eval prompts")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    parser.add_argument("--num-draft", type=int_list, default=[0, 1, 2, 3])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--markdown", help="write the table as markdown here")
    return parser


def time_ours(model, ids, lens, num_draft: int, max_new_tokens: int, repeats: int) -> dict:
    import jax

    from mtp_jax.config import DecodeConfig
    from mtp_jax.speculative import compile_generate
    from mtp_jax.stats import add, summarize

    cfg = DecodeConfig(num_draft=num_draft, max_new_tokens=max_new_tokens)
    key = jax.random.key(0)
    start = time.perf_counter()
    run = compile_generate(model, ids, lens, key, cfg)
    compile_seconds = time.perf_counter() - start
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(run(model, ids, lens, key, cfg))
        walls.append(time.perf_counter() - start)
    wall = statistics.median(walls)
    generated = int(np.sum(np.asarray(out.lengths)))
    summary = summarize(add(None, out.stats), num_draft=num_draft, generated_tokens=generated, wall=wall,
                        compile_seconds=compile_seconds)  # fmt: skip
    summary["ms_per_round"] = 1000 * wall / max(summary["rounds"], 1)
    summary["tokens"] = [np.asarray(out.tokens[r, : out.lengths[r]]).tolist() for r in range(len(lens))]
    return summary


def load_peer(gguf_or_folder: str):
    """transformers' float32 model of the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    if gguf_or_folder.endswith(".gguf"):
        folder, name = os.path.split(gguf_or_folder)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(gguf_or_folder, dtype=torch.float32).eval()


def time_peer(model, prompts, max_new_tokens: int, repeats: int, eos_ids) -> dict:
    """transformers' generate (greedy), left-padded batch, static cache if it works."""
    import torch

    width = max(len(p.token_ids) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
        mask[row, width - len(p.token_ids) :] = 1
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                  eos_token_id=list(eos_ids) or None)  # fmt: skip
    cache = "static"
    try:
        with torch.no_grad():
            model.generate(ids, cache_implementation="static", **kwargs)
    except Exception as e:  # an unsupported cache on this platform: fall back to the default cache
        print(f"note: static cache unavailable for the peer ({type(e).__name__}); using the dynamic cache",
              file=sys.stderr)  # fmt: skip
        cache = "dynamic"
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **({"cache_implementation": "static"} if cache == "static" else {}), **kwargs)
        walls.append(time.perf_counter() - start)
    new = out[:, width:]
    tokens = []
    for row in new.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        tokens.append(row[:cut])
    wall = statistics.median(walls)
    generated = sum(len(t) for t in tokens)
    return {"tokens_per_second": generated / wall, "wall_seconds": wall, "generated_tokens": generated,
            "cache": cache, "tokens": tokens}  # fmt: skip


def run(args) -> list[dict]:
    from mtp_jax import checkpoint
    from mtp_jax.default_model import default_gguf_path
    from mtp_jax.prompts import bucket, encode_prompts, pad_batch, read_prompt_file

    if args.max_new_tokens < 1 or args.repeats < 1 or 0 in args.batch_sizes:
        raise UserError("--max-new-tokens, --repeats and batch sizes must be >= 1")
    items = read_prompt_file(args.prompts_file)
    model, tokenizer = checkpoint.load(args.model, dtype=args.dtype, head=args.head)
    cfg = model.config
    drafts = [k for k in args.num_draft if k == 0 or cfg.has_mtp]
    if len(drafts) < len(args.num_draft):
        print("note: the model has no MTP head; timing k = 0 only", file=sys.stderr)
    prompts = encode_prompts(items, tokenizer, chat=True, vocab_size=cfg.vocab_size,
                             context=cfg.max_position_embeddings)  # fmt: skip
    rows, peer_model = [], None
    source = args.model or default_gguf_path()
    if not args.no_peer and os.path.isdir(source) and checkpoint.is_converted(source):
        print("note: no peer for a converted folder", file=sys.stderr)
    elif not args.no_peer:
        peer_model = load_peer(source)
    for batch_size in args.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        ids, lens = pad_batch(batch, batch_size, bucket(max(len(p.token_ids) for p in batch)))
        plain = None
        for k in drafts:
            result = time_ours(model, ids, lens, k, args.max_new_tokens, args.repeats)
            plain = plain or (result if k == 0 else None)
            rows.append({"impl": "mtp_jax", "batch": batch_size, "k": k, **result})
        if peer_model is not None:
            peer = time_peer(peer_model, batch, args.max_new_tokens, args.repeats, cfg.eos_token_ids)
            rows.append({"impl": "transformers", "batch": batch_size, "k": 0, **peer})
        reference = next(r for r in rows if r["impl"] == "mtp_jax" and r["batch"] == batch_size and r["k"] == 0)
        for row in rows:
            if row["batch"] == batch_size:
                row["speedup_vs_plain"] = row["tokens_per_second"] / reference["tokens_per_second"]
                row["same_tokens_as_plain"] = row["tokens"] == reference["tokens"]
    return rows


def markdown(rows: list[dict], command: str) -> str:
    import jax
    import jaxlib

    from mtp_jax.stats import describe_device

    versions = f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"
    try:
        import torch
        import transformers

        versions += f", torch {torch.__version__}, transformers {transformers.__version__}"
    except ImportError:
        pass
    lines = [
        f"- command: `{command}`",
        f"- device: {describe_device()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        f"- versions: {versions}; date: {datetime.date.today().isoformat()}",
        "",
        "| impl | batch | k | tokens/s | ms/round | mean accepted len | accept/pos | speedup vs plain | same tokens | "
        "compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_pos = ", ".join(f"{p:.2f}" for p in r.get("acceptance_per_position", []))
        lines.append(
            f"| {r['impl']}{' (' + r['cache'] + ' cache)' if 'cache' in r else ''} | {r['batch']} | {r['k']} | "
            f"{r['tokens_per_second']:.1f} | {r.get('ms_per_round', float('nan')):.1f} | "
            f"{r.get('mean_accepted_length', 1.0):.2f} | {per_pos or '-'} | {r['speedup_vs_plain']:.2f}x | "
            f"{'yes' if r['same_tokens_as_plain'] else 'no'} | {r.get('compile_seconds', 0.0):.1f} |"
        )
    return "\n".join(lines) + "\n"


def report(rows: list[dict], args, command: str) -> int:
    table = markdown(rows, command)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows], f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = "python -m mtp_jax.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    return run_cli(lambda parsed: report(run(parsed), parsed, command), args)


if __name__ == "__main__":
    sys.exit(main())
