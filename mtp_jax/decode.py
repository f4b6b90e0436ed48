"""python -m mtp_jax.decode: batch generation from prompts to JSONL, with MTP drafting when the model has a head."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from mtp_jax.errors import UserError, run_cli


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.decode", description=__doc__)
    parser.add_argument("--model", help="Hugging Face folder, converted folder or .gguf (default: SmolLM2-135M)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--prompts-file", help=".txt (a prompt a line) or .jsonl (prompt or token_ids a line)")
    parser.add_argument("--head", help="MTP head folder from train_head (default: the model's own or shipped head)")
    parser.add_argument("--out", help="output JSONL (default: stdout)")
    parser.add_argument("--num-draft", type=non_negative_int, help="drafts per round (default 3 with a head)")
    parser.add_argument("--no-mtp", action="store_true", help="plain decoding through the same loop (k = 0)")
    parser.add_argument("--adaptive", action="store_true", help="each round drafts 0..K tokens (K = --num-draft), "
                        "chosen on device from running acceptance and --round-costs")  # fmt: skip
    parser.add_argument("--round-costs", type=float_list, metavar="C0,...,CK", help="with --adaptive: time of a "
                        "round with 0..K drafts over a plain step, as python -m mtp_jax.bench measures them "
                        "(default: estimated from parameter bytes, right for memory-bound accelerators)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=non_negative_int, default=0)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--mesh", help="shard over every device: data=D,model=M[,expert=E] or auto (all on model); "
                        "--batch-size is rounded up to a multiple of D")  # fmt: skip
    add_distributed_arguments(parser)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--stats-json", help="write decode statistics here")
    return parser


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several processes (hosts): run the same command in each")
    auto = "jax.distributed.initialize() from the environment (TPU pod slice, SLURM, Open MPI)"
    group.add_argument("--distributed", action="store_true", help=auto)
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (with the next two options)")
    group.add_argument("--num-processes", type=positive_int)
    group.add_argument("--process-id", type=non_negative_int)


def start_distributed(args) -> None:
    """Join the multi-process runtime when asked (before JAX touches a device)."""
    manual = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in manual) and any(v is None for v in manual):
        raise UserError("--coordinator, --num-processes and --process-id go together")
    if not args.distributed and manual[0] is None:
        return
    import jax

    try:
        jax.distributed.initialize(*manual)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"jax.distributed.initialize failed: {e}") from None


def float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def choose_num_draft(args, has_mtp: bool) -> int:
    if args.no_mtp:
        return 0
    if args.num_draft is not None:
        if args.num_draft > 0 and not has_mtp:
            raise UserError("this model has no MTP head: use --no-mtp (or --num-draft 0)")
        return args.num_draft
    if not has_mtp:
        print("note: this model has no MTP head; decoding without drafts (k = 0)", file=sys.stderr)
        return 0
    return 3


def write_atomically(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes owner-only files; give the usual permissions
    os.replace(tmp, path)


def run(args) -> int:
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.model is not None and not os.path.exists(args.model):
        raise UserError(f"{args.model}: no such model file or folder")
    if args.round_costs is not None and not args.adaptive:
        raise UserError("--round-costs goes with --adaptive")
    records = read_records(args)
    start_distributed(args)

    import jax
    import numpy as np
    from tqdm import tqdm

    from mtp_jax import checkpoint, stats
    from mtp_jax.config import DecodeConfig
    from mtp_jax.prompts import bucket, encode_prompts, pad_batch
    from mtp_jax.sharding import make_mesh, to_host
    from mtp_jax.speculative import compile_generate

    try:
        mesh = make_mesh(args.mesh) if args.mesh else None
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    model, tokenizer = checkpoint.load(args.model, dtype=args.dtype, head=args.head, mesh=mesh)
    lead = jax.process_index() == 0  # every process decodes its shards; the first one writes
    cfg = model.config
    num_draft = choose_num_draft(args, cfg.has_mtp)
    prompts = encode_prompts(
        [item for item, _ in records],
        tokenizer,
        chat=not args.no_chat,
        vocab_size=cfg.vocab_size,
        context=cfg.max_position_embeddings,
    )
    if args.adaptive and num_draft == 0:
        raise UserError("--adaptive needs drafts: a model with an MTP head and --num-draft > 0")
    try:
        decode_cfg = DecodeConfig(
            num_draft=num_draft,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            adaptive=args.adaptive,
            round_costs=args.round_costs,
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    batch_size = min(args.batch_size, len(prompts))
    if model.sharding_rules is not None:  # every data shard gets the same number of rows (padding repeats a row)
        shards = model.sharding_rules.axis_size("batch")
        batch_size = -(-batch_size // shards) * shards
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    row_sampling = per_row_sampling(args, [overrides for _, overrides in records])
    compiled, compile_seconds, wall, counters = {}, 0.0, 0.0, None
    records = []
    for batch in tqdm(batches, desc="decoding", unit="batch", disable=len(batches) < 2 or not lead, file=sys.stderr):
        width = bucket(max(len(p.token_ids) for p in batch))
        ids, lens = pad_batch(batch, batch_size, width)
        rows = np.asarray([p.index for p in batch] + [batch[0].index] * (batch_size - len(batch)))
        keys, sampling = row_sampling(rows)
        if width not in compiled:
            start = time.perf_counter()
            compiled[width] = compile_generate(model, ids, lens, keys, decode_cfg, sampling)
            compile_seconds += time.perf_counter() - start
        start = time.perf_counter()
        out = jax.block_until_ready(compiled[width](model, ids, lens, keys, decode_cfg, sampling))
        wall += time.perf_counter() - start
        counters = stats.add(counters, out.stats)
        tokens, lengths, by_eos = (to_host(x) for x in (out.tokens, out.lengths, out.finished_by_eos))
        for row, prompt in enumerate(batch):
            generated = tokens[row, : lengths[row]].tolist()
            records.append(
                {
                    "index": prompt.index,
                    "prompt": prompt.text if prompt.text is not None else list(prompt.token_ids),
                    "text": tokenizer.decode(generated, skip_special_tokens=True) if tokenizer else "",
                    "token_ids": generated,
                    "num_tokens": len(generated),
                    "finish_reason": "eos" if by_eos[row] else "length",
                }
            )
    generated_tokens = sum(r["num_tokens"] for r in records)
    summary = stats.summarize(
        counters, num_draft=num_draft, generated_tokens=generated_tokens, wall=wall, compile_seconds=compile_seconds
    )
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if not lead:
        return 0
    if args.out:
        write_atomically(args.out, lines)
    else:
        sys.stdout.write(lines)
    if args.stats_json:
        write_atomically(args.stats_json, json.dumps(summary, indent=2) + "\n")
    print(stats.summary_paragraph(summary, len(records)), file=sys.stderr)
    return 0


def read_records(args) -> list[tuple[str | list[int], dict]]:
    """(prompt, per-row sampling overrides) for each prompt."""
    from mtp_jax.prompts import read_prompt_records

    if args.prompts_file:
        return read_prompt_records(args.prompts_file)
    return [(prompt, {}) for prompt in args.prompt]


def per_row_sampling(args, overrides: list[dict]):
    """A function of prompt indices [B] -> (one key per row [B], SamplingParams or None when every row is greedy).

    A row's key is `key(seed)` when its line sets a seed, else `fold_in(key(--seed), prompt index)`: every row has
    its own stream, whatever rows share its batch.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mtp_jax.sampling import SamplingParams

    defaults = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    table = {name: np.array([o.get(name, value) for o in overrides]) for name, value in defaults.items()}
    base_key = jax.random.key(args.seed)
    own_seed = [o.get("seed") for o in overrides]
    all_greedy = not table["temperature"].any()

    def for_rows(rows: np.ndarray):
        keys = jnp.stack([
            jax.random.key(own_seed[r]) if own_seed[r] is not None else jax.random.fold_in(base_key, int(r))
            for r in rows
        ])  # fmt: skip
        if all_greedy:
            return keys, None
        sampling = SamplingParams(
            temperature=jnp.asarray(table["temperature"][rows], jnp.float32),
            top_k=jnp.asarray(table["top_k"][rows], jnp.int32),
            top_p=jnp.asarray(table["top_p"][rows], jnp.float32),
        )
        return keys, sampling

    return for_rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(run, args)


if __name__ == "__main__":
    sys.exit(main())
