"""python -m mtp_jax.decode: batch generation from prompts to JSONL, with MTP drafting when the model has a head.

Rows are written as their batch finishes: to stdout (as plain text, a block per prompt, when stdout is a terminal;
a lone prompt's answer there appears as it is generated, `text_stream.stream_prompt`), or to FILE.partial-<settings>
beside --out, renamed to --out when every row is there. A run that stops early keeps its finished rows there, and
--resume continues it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax

from mtp_jax.cli.arguments import (
    TREE_DEPTH,
    add_distributed_arguments,
    add_storage_arguments,
    add_tree_arguments,
    check_output_path,
    float_list,
    non_negative_int,
    positive_int,
    start_distributed,
)
from mtp_jax.cli.decode_output import RowOutput, open_output
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode import default_drafting, stats
from mtp_jax.decode.prompts import encode_prompts, read_prompt_records
from mtp_jax.decode.speculative import checked_decode_config
from mtp_jax.decode.text import batch_rows, check_budget, decode_batches, first_batch, row_sampling
from mtp_jax.decode.text_stream import stream_prompt
from mtp_jax.decode.tree import check_tree_model
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.loading import checkpoint
from mtp_jax.loading.hub import MODEL_HELP, names_a_model
from mtp_jax.models import causal_lm
from mtp_jax.parallel.sharding import make_mesh
from mtp_jax.quant.int8_activations import has_int8_activations
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.errors import UserError, run_cli
from mtp_jax.runtime.files import write_atomically


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.decode", description=__doc__)
    parser.add_argument("--model", help=f"{MODEL_HELP} (default: SmolLM2-135M)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--prompts-file", help=".txt (a prompt a line) or .jsonl (prompt or token_ids a line)")
    parser.add_argument("--head", help="MTP head folder from train_head (default: the model's own or shipped head)")
    parser.add_argument("--out", help="output JSONL (default: stdout; text, a block per prompt, on a terminal)")
    parser.add_argument("--resume", action="store_true", help="keep the rows an earlier run with the same settings "
                        "finished (in --out's partial file, or in --out) and decode only the rest")  # fmt: skip
    parser.add_argument(
        "--num-draft", type=non_negative_int, help="drafts per round (default with a head: 1 on a CPU, 3 elsewhere)"
    )
    parser.add_argument("--no-mtp", action="store_true", help="plain decoding through the same loop (k = 0)")
    add_tree_arguments(parser)
    parser.add_argument("--adaptive", action="store_true", help="each round drafts 0..K tokens (K = --num-draft) "
                        "or, with --tree, a draft tree, chosen on device from running acceptance and "
                        "--round-costs")  # fmt: skip
    parser.add_argument("--round-costs", type=float_list, metavar="C0,...,CK", help="with --adaptive: time of a "
                        "round with 0..K drafts (then, with --tree, a tree round) over a plain step, as python -m "
                        "mtp_jax.bench measures them (default: estimated from parameter bytes, right for "
                        "memory-bound accelerators)")  # fmt: skip
    parser.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=DecodeConfig.invariant,
                        help="batch-invariant numerics: each row's tokens the same at any batch size, and greedy MTP "
                        "equal to plain decoding in bfloat16 too")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=non_negative_int, default=0)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="rows decoded at once (default 8); more "
                        "prompts than rows take a row as another's answer ends (slots that refill)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--mesh", help="shard over D*M*E devices (the first ones; every device of every process in "
                        "a multi-process run): data=D,model=M[,expert=E] or auto (all on model); --batch-size is "
                        "rounded up to a multiple of D")  # fmt: skip
    add_distributed_arguments(parser)
    add_storage_arguments(parser)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--stats-json", help="write decode statistics here")
    compile_cache.add_argument(parser)
    return parser


def choose_num_draft(args, has_mtp: bool) -> int:
    if args.no_mtp:
        return 0
    if args.tree and args.num_draft is None:
        args.num_draft = TREE_DEPTH
    if args.num_draft is not None:
        if args.num_draft > 0 and not has_mtp:
            raise UserError("this model has no MTP head: use --no-mtp (or --num-draft 0)")
        return args.num_draft
    if not has_mtp:
        print("note: this model has no MTP head; decoding without drafts (k = 0)", file=sys.stderr)
        return 0
    platform = "cpu" if jax.default_backend() == "cpu" else "other"
    return default_drafting.DEFAULT_DRAFTS[platform]  # the most a round drafts: `default_decode_config` chooses


def check_model_and_drafting(args) -> None:
    """--model names a model; --round-costs and --tree go with the drafting they need (decode's and serve's)."""
    if args.model is not None and not names_a_model(args.model):
        raise UserError(f"{args.model}: no such model file or folder")
    if args.round_costs is not None and not args.adaptive:
        raise UserError("--round-costs goes with --adaptive")
    if args.tree and args.no_mtp:
        raise UserError("--tree drafts with the MTP head: not with --no-mtp")


def run(args) -> int:
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    check_model_and_drafting(args)
    if args.resume and not args.out:
        raise UserError("--resume goes with --out")
    for option, path in (("--out", args.out), ("--stats-json", args.stats_json)):
        if path is not None:
            check_output_path(path, option)
    if args.out and args.stats_json and os.path.abspath(args.out) == os.path.abspath(args.stats_json):
        raise UserError("--out and --stats-json name the same file")
    records = read_records(args)
    start_distributed(args)

    lead = jax.process_index() == 0  # every process decodes its shards; the first one writes
    output, done = open_output(args, [item for item, _ in records], lead)
    try:
        summary = decode_rows(args, records, output, done, lead)
    except BaseException as e:
        note = output.abandon() if lead else ""
        if isinstance(e, KeyboardInterrupt) and note:
            raise KeyboardInterrupt(note) from None
        raise
    if not lead:
        return 0
    output.finish()
    if summary is None:
        print(f"all {len(records)} rows were already in {args.out}: nothing decoded, no statistics", file=sys.stderr)
        return 0
    if args.stats_json:
        write_atomically(args.stats_json, json.dumps(summary, indent=2) + "\n")
    print(stats.summary_paragraph(summary, len(records) - done), file=sys.stderr)
    return 0


def decode_rows(args, records, output: RowOutput | None, done: int, lead: bool) -> dict | None:
    """Decode the prompts from `done` on, batch by batch, each batch's rows to `output` (process 0) as it finishes;
    the statistics summary of the run (None when every row was already done)."""
    start = time.perf_counter()
    cpu_rows.prepare()  # a first run builds the CPU's row kernel while the model loads
    model, tokenizer, prompts, decode_cfg, batch_size = load_for_decoding(args, records)
    load_seconds = time.perf_counter() - start
    if lead and model.sharding_rules is None:
        note_without_kernel()
    if not prompts[done:]:
        return None
    sampling = row_sampling(decode_cfg, args.seed, [overrides for _, overrides in records])
    plan = {"execution_plan": checked_decode_config(model, decode_cfg).plan.as_dict()}
    if lead and output.terminal and tokenizer is not None and len(prompts) - done == 1 and jax.process_count() == 1:
        result, summary = stream_prompt(model, tokenizer, prompts[done], decode_cfg, sampling, output.show)
        output.shown(result.row())
        return {"load_seconds": load_seconds, **summary, **drafting_note(args), **plan}
    write = (lambda results: output.write([r.row() for r in results])) if lead else (lambda results: None)
    summary = decode_batches(model, tokenizer, prompts[done:], decode_cfg, batch_size, sampling, write, progress=lead)
    return {"load_seconds": load_seconds, **summary, **drafting_note(args), **plan}


def drafting_note(args) -> dict:
    """The stats' "drafting" field: what the default drafting chose and why (absent where the options chose)."""
    return {"drafting": args.drafting} if getattr(args, "drafting", None) else {}


def note_without_kernel() -> None:
    """One line when a run on one CPU device goes without the row kernel, which it could not build or load (not when
    $MTP_JAX_NATIVE=0 turned it off): decoding still works, its products on XLA several times slower."""
    if jax.default_backend() != "cpu" or os.environ.get(cpu_rows.DISABLE_ENV) == "0":
        return
    status = cpu_rows.status()
    if status != "ready":
        print(f"mtp_jax: the CPU row kernel is {status}; products run on XLA, several times slower", file=sys.stderr)


def load_for_decoding(args, records) -> tuple:
    """(model, tokenizer, encoded prompts, DecodeConfig, batch size) as the options say; settings that cannot run
    are refused here, before compiling."""
    try:
        mesh = make_mesh(args.mesh) if args.mesh else None
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    model, tokenizer = checkpoint.load(
        args.model, dtype=args.dtype, head=args.head, mesh=mesh, weights=args.weights, activations=args.activations
    )
    model = causal_lm.hold_for_platform(model, args.layer_layout)
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
    decode_cfg = decode_config(args, num_draft)
    if decode_cfg.tree:
        try:
            invariant = decode_cfg.invariant or has_int8_activations(model)  # as `speculative.generate` decodes it
            check_tree_model(model, dataclasses.replace(decode_cfg, invariant=invariant))
        except ValueError as e:
            raise UserError(f"--tree: {e}") from None
    batch_size = batch_rows(model, args.batch_size, len(prompts))
    check_budget(model, prompts, decode_cfg, batch_size)
    decode_cfg = default_decode_config(args, model, decode_cfg, first_batch(prompts, batch_size))
    return model, tokenizer, prompts, decode_cfg, batch_size


def default_decode_config(args, model, cfg: DecodeConfig, batch: tuple) -> DecodeConfig:
    """`cfg` with the drafting that pays here where the options leave it open: no --num-draft (and no --no-mtp),
    or --adaptive without --round-costs (default_drafting.py), timed on `batch` (ids [B, W], lens [B]: the first
    batch decoded). Its reason goes to the summary."""
    args.drafting = None
    leaves_open = args.num_draft is None or (args.adaptive and args.round_costs is None)
    if args.no_mtp or not model.config.has_mtp or not leaves_open:
        return cfg
    invariant = cfg.invariant or has_int8_activations(model)  # as `speculative.generate` decodes it
    max_draft = args.num_draft if args.adaptive else None
    tree = (cfg.tree, cfg.tree_width)
    drafting = default_drafting.choose(model, *batch, invariant, max_draft, adaptive=args.adaptive, tree=tree)
    args.drafting = drafting.reason
    return default_drafting.apply(cfg, drafting)


def decode_config(args, num_draft: int) -> DecodeConfig:
    try:
        return DecodeConfig(
            num_draft=num_draft,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            adaptive=args.adaptive,
            round_costs=args.round_costs,
            invariant=args.invariant,
            tree=args.tree if num_draft else 0,
            tree_width=args.tree_width,
        )
    except ValueError as e:
        raise UserError(str(e)) from None


def read_records(args) -> list[tuple[str | list[int], dict]]:
    """(prompt, per-row sampling overrides) for each prompt."""
    if args.prompts_file:
        return read_prompt_records(args.prompts_file)
    return [(prompt, {}) for prompt in args.prompt]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with compile_cache.active(args.no_compile_cache):
        return run_cli(run, args)
