"""python -m mtp_jax.bench: plain vs MTP decoding, transformers' PyTorch generate and llama.cpp, in one process.

For each (batch size, k) the decode loop is compiled once ahead of time (timed apart); then every configuration of
a batch size (ours for each k, the adaptive loop, the peers of `bench_peers`) runs once per sweep, `--repeats`
sweeps, and each keeps its fastest wall time: interference from the rest of the machine only ever adds time, and
interleaving (in alternating order) spreads a slow spell over all configurations. EOS does not stop any row, on
either side, so every row generates exactly --max-new-tokens tokens and tokens/s compare equal work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import numpy as np
from flax import nnx

from mtp_jax.bench.environment import header_lines, metadata
from mtp_jax.bench.peers import LlamaCppRun, PeerRun, llama_cpp_available, load_llama_cpp, load_peer
from mtp_jax.bench.timing import measured_bandwidth, ratio, time_batch
from mtp_jax.cli.arguments import add_storage_arguments, positive_int
from mtp_jax.cli.bench_serve import run_serve, serve_markdown
from mtp_jax.cli.bench_slots import refill_markdown, run_refill
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.engine import PREFILL_CHUNK
from mtp_jax.decode.prompts import bucket, encode_prompts, pad_batch, read_prompt_file
from mtp_jax.decode.tree import check_tree_model
from mtp_jax.loading import checkpoint
from mtp_jax.loading.default_model import default_gguf_path
from mtp_jax.loading.hub import MODEL_HELP, local_path, names_a_model
from mtp_jax.models import causal_lm
from mtp_jax.parallel.sharding import make_mesh, shard_model
from mtp_jax.plan.shapes import SHAPES
from mtp_jax.quant.formats import quantize_model
from mtp_jax.quant.int8_activations import has_int8_activations
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.errors import OneLineParser, UserError, run_cli

DEFAULT_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Hi! Can you recommend a good book for a long train ride?",
    "What is 17 multiplied by 23? Show your steps.",
    "Summarize in two sentences: The city council voted to extend the bike lane network by 40 kilometres over "
    "the next three years, funded by a mix of national grants and local parking fees.",
    "Explain what a hash map is to a beginner programmer.",
    "A train leaves at 9:40 and arrives at 13:15. How long is the journey?",
    "Write a SQL query that returns the ten most recent orders from an orders table.",
    "Give me three tips for staying focused while working from home.",
)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m mtp_jax.bench", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"{MODEL_HELP} (default: SmolLM2-135M)")
    source.add_argument("--random-shape", choices=sorted(SHAPES), help="time random weights of a named shape")
    parser.add_argument("--head", help="MTP head folder from train_head (default: the model's own or shipped head)")
    parser.add_argument("--prompts-file", help=".txt or .jsonl (default: 8 built-in prompts: code, chat, math, ...)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8], help="default 1,8")
    parser.add_argument("--num-draft", type=int_list, default=[0, 1, 2, 3], help="k values (0 always runs)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="per row (default 64)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default float32 on CPU, else bfloat16")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per configuration (default 3)")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, help="time transformers' generate too, and "
                        "llama.cpp at batch 1 for a GGUF when llama-cpp-python is installed (default: on, off for "
                        "random shapes)")  # fmt: skip
    parser.add_argument("--split", action=argparse.BooleanOptionalAction, default=True, help="time each round's "
                        "draft and verify parts, the roofline and the adaptive round costs (default on)")  # fmt: skip
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, help="add an adaptive-k row with the "
                        "largest k, its round costs from the split timing (default: on with --split)")  # fmt: skip
    parser.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=DecodeConfig.invariant,
                        help="ours with batch-invariant numerics (default: as DecodeConfig)")  # fmt: skip
    parser.add_argument("--tree", type=int_list, default=[], metavar="N,...", help="add a draft tree row for each "
                        "node budget N, as deep as the largest --num-draft")  # fmt: skip
    parser.add_argument("--tree-width", type=positive_int, default=4, metavar="W",
                        help="with --tree: nodes expanded at each depth, and children each proposes")  # fmt: skip
    parser.add_argument("--invariance-cost", action="store_true", help="time ours with the other numerics too, "
                        "for every k, in the same sweeps (rows marked 'invariant' or 'default numerics')")  # fmt: skip
    parser.add_argument("--mesh", help="shard ours over D*M*E devices (the first ones; all of them in a multi-process "
                        "run): data=D,model=M[,expert=E] or auto (every device on model)")  # fmt: skip
    add_storage_arguments(parser)
    parser.add_argument("--refill", action="store_true", help="instead: decode --prompts held-out prompts through "
                        "slots that refill and through static batches of each --batch-sizes rows, side by side "
                        "(answers end at EOS; --max-new-tokens caps them)")  # fmt: skip
    parser.add_argument("--serve", action="store_true", help="instead: a load test of python -m mtp_jax.serve with "
                        "--batch-sizes slots, without MTP and with the largest --num-draft, through the openai "
                        "client, beside the same engine's offline rate")  # fmt: skip
    parser.add_argument("--prompts", type=positive_int, default=128, help="with --refill or --serve: how many held-out "
                        "prompts (cycled; default 128)")  # fmt: skip
    parser.add_argument("--clients", type=positive_int, default=16, help="with --serve: requests in flight at most")
    parser.add_argument("--prefill-chunk", type=positive_int, default=PREFILL_CHUNK, help="with --serve: the "
                        f"server's --prefill-chunk (default {PREFILL_CHUNK}; a run of whole prompts too)")  # fmt: skip
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="with --serve: Poisson arrivals a "
                        "second (default inf: all at once)")  # fmt: skip
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the table as markdown here")
    compile_cache.add_argument(parser)
    return parser


def load_target(args, notes: list[str]):
    """(model, tokenizer or None, label, peer source path or None)."""
    try:
        mesh = make_mesh(args.mesh) if args.mesh else None
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    if args.random_shape:
        dtype = args.dtype or checkpoint.default_dtype()
        model = causal_lm.CausalLM(SHAPES[args.random_shape](), dtype=dtype, rngs=nnx.Rngs(0))
        model = quantize_model(model if mesh is None else shard_model(model, mesh), args.weights)
        model = checkpoint.with_activations(model, args.activations, None, args.weights)
        return (
            causal_lm.hold_for_platform(model, args.layer_layout),
            None,
            f"random weights, shape {args.random_shape}",
            None,
        )
    if args.activations == "int8" and not args.invariant:
        args.invariant = True  # as `speculative.generate` decodes such a model: reported as it runs
        notes.append("activations rounded to int8: batch-invariant decoding (DecodeConfig.invariant), always")
    path = local_path(args.model) if args.model else None  # a repo id: its snapshot folder, for the peer too
    model, tokenizer = checkpoint.load(
        path, dtype=args.dtype, head=args.head, mesh=mesh, weights=args.weights, activations=args.activations
    )
    path = path or default_gguf_path()
    model = causal_lm.hold_for_platform(model, args.layer_layout)
    if args.peer is False:
        return model, tokenizer, path, None
    if os.path.isdir(path) and checkpoint.is_converted(path):
        notes.append("no transformers peer for a converted mtp_jax folder")
        return model, tokenizer, path, None
    return model, tokenizer, path, path


def read_prompts(args, model, tokenizer):
    """Encoded prompts; random weights without a prompts file get fixed random token ids (16..58 tokens)."""
    cfg = model.config
    if args.prompts_file:
        items = read_prompt_file(args.prompts_file)
    elif tokenizer is None:
        rng = np.random.default_rng(0)
        items = [rng.integers(0, cfg.vocab_size, 16 + 6 * i).tolist() for i in range(len(DEFAULT_PROMPTS))]
    else:
        items = list(DEFAULT_PROMPTS)
    return encode_prompts(items, tokenizer, chat=True, vocab_size=cfg.vocab_size, context=cfg.max_position_embeddings)


def run(args) -> dict:
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.model is not None and not names_a_model(args.model):
        raise UserError(f"{args.model}: no such model file or folder")
    if args.random_shape and (args.head or args.peer):
        raise UserError("--random-shape takes no --head and has no transformers peer (--peer)")
    if 0 in args.batch_sizes:
        raise UserError("--batch-sizes must be >= 1")
    if args.refill and args.serve:
        raise UserError("--refill and --serve are two different runs: one at a time")
    if not args.request_rate > 0:
        raise UserError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.adaptive and not args.split:
        raise UserError("--adaptive needs --split: the adaptive round costs come from the split timing")
    args.adaptive = args.split if args.adaptive is None else args.adaptive
    notes: list[str] = []
    model, tokenizer, label, peer_path = load_target(args, notes)
    if model.sharding_rules is not None:
        shards = model.sharding_rules.axis_size("batch")
        if any(b % shards for b in args.batch_sizes):
            raise UserError(f"--batch-sizes must be multiples of the mesh's data axis ({shards})")
        notes.append(f"ours sharded over mesh {dict(model.sharding_rules.mesh.shape)}")
    drafts = sorted({0, *args.num_draft})
    if not model.config.has_mtp and drafts != [0]:
        drafts = [0]
        notes.append("the model has no MTP head: k > 0 skipped")
    check_trees(args, model, max(drafts))
    dtype = np.dtype(model.dtype).name
    if args.refill:
        return run_refill(args, model, tokenizer, label, dtype, notes)
    if args.serve:
        return run_serve(args, model, tokenizer, label, dtype, notes)
    prompts = read_prompts(args, model, tokenizer)
    peer = load_peer(peer_path, dtype) if peer_path else None
    llama = llama_cpp_peer(args, peer_path, prompts, notes)
    bandwidth = measured_bandwidth() if args.split else None
    rows = []
    for batch_size in args.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        ids, lens = pad_batch(batch, batch_size, bucket(max(len(p.token_ids) for p in batch)))  # [B, W], [B]
        results = time_batch(args, model, ids, lens, drafts, bandwidth, peer_runs(args, batch, peer, llama))
        plain, plain_tokens = results[0]
        plain_of_mode = {
            row["invariant"]: tokens for row, tokens in results if row["impl"] == "mtp_jax" and not row["k"]
        }
        peer_speed = next((r["tokens_per_second"] for r, _ in results if r["impl"] == "transformers"), None)
        for row, tokens in results:
            row["speedup_vs_plain"] = row["tokens_per_second"] / plain["tokens_per_second"]
            row["verify_over_plain"] = ratio(row.get("verify_ms"), plain.get("round_ms"))
            row["round_over_plain"] = ratio(row.get("ms_per_round"), plain.get("ms_per_round"))  # a MoE's round price
            row["draft_step_over_plain"] = ratio(row.get("draft_ms"), plain.get("round_ms"), row["k"])
            row["ours_over_peer"] = row["tokens_per_second"] / peer_speed if peer_speed else None
            reference = plain_of_mode.get(row.get("invariant"), plain_tokens)  # plain decoding with the same numerics
            compared = reference is not tokens and args.temperature == 0
            row["same_tokens"] = bool(np.array_equal(tokens, reference)) if compared else None
            rows.append(row)
            print(progress_line(row), file=sys.stderr, flush=True)
    if peer is not None:
        cache = next(r["cache"] for r in rows if r["impl"] == "transformers")
        notes.append(f"transformers ran with the {cache} cache on {peer.device.type}")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    meta = metadata(args, label, dtype, notes, model)
    meta["copy_bandwidth_gb_s"] = None if bandwidth is None else bandwidth / 1e9
    return {"meta": meta, "rows": rows}


def check_trees(args, model, depth: int) -> None:
    """A clear line for --tree budgets that cannot run here (DecodeConfig's checks, speculative's model checks)."""
    for budget in args.tree:
        try:
            invariant = args.invariant or has_int8_activations(model)  # as `speculative.generate` decodes it
            cfg = DecodeConfig(num_draft=depth, tree=budget, tree_width=args.tree_width, invariant=invariant)
            if depth == 0:
                raise ValueError("a draft tree needs --num-draft >= 1 (its depth) and a model with an MTP head")
            check_tree_model(model, cfg)
        except ValueError as e:
            raise UserError(f"--tree {budget}: {e}") from None


def llama_cpp_peer(args, peer_path: str | None, prompts, notes: list[str]):
    """llama.cpp's model of the GGUF for the batch-1 rows, when it can be a peer (greedy only), else None."""
    if not llama_cpp_available(peer_path):
        return None
    if args.temperature:
        notes.append("llama.cpp is timed at temperature 0 only")
        return None
    context = max(len(p.token_ids) for p in prompts) + args.max_new_tokens + 8
    try:
        llama = load_llama_cpp(peer_path, context)
    except ImportError as e:  # installed without its own dependencies: not a peer, said in the table's notes
        notes.append(f"llama.cpp not timed: llama_cpp does not import ({e})")
        return None
    notes.append("llama.cpp runs at batch 1 only, on the CPU, with the GGUF's own quantized weights")
    return llama


def peer_runs(args, batch, peer, llama) -> list[tuple[str, object]]:
    """(name, run) of each peer for one batch of prompts: transformers' model `peer` and, at batch 1, llama.cpp's
    model `llama` (either None when it is not a peer)."""
    runs = [("transformers", PeerRun(peer, batch, args.max_new_tokens, args.temperature))] if peer is not None else []
    if llama is not None and len(batch) == 1:
        runs.append(("llama.cpp", LlamaCppRun(llama, batch, args.max_new_tokens)))
    return runs


def progress_line(row: dict) -> str:
    """One finished row, printed as soon as its batch is timed (a run cut short keeps what it measured)."""
    numerics = {True: ", invariant", False: ", default numerics"}.get(row.get("invariant"), "")
    same = {True: "; same tokens as plain", False: "; tokens differ from plain"}.get(row["same_tokens"], "")
    return (f"done: {row['impl']}, batch {row['batch']}, k {row['k']}{numerics}: "
            f"{row['tokens_per_second']:.1f} tokens/s{same}")  # fmt: skip


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        *header_lines(meta),
        f"- model: {meta['model']} ({meta['dtype']}); prompts: {meta['prompts']}; {meta['max_new_tokens']} new tokens "
        f"per row; temperature {meta['temperature']}; fastest of {meta['repeats']} interleaved runs",
        *(f"- note: {note}" for note in meta["notes"]),
    ]
    if meta.get("copy_bandwidth_gb_s"):
        kind = "streaming read over every core" if "cpu" in meta["device"] else "copy"
        lines.append(f"- measured bandwidth ({kind}): {meta['copy_bandwidth_gb_s']:.1f} GB/s (roofline = bytes a "
                     "plain step reads / its time, timed as a loop of plain rounds, over it)")  # fmt: skip
    lines += [
        "",
        "| impl | batch | k | tokens/s | prefill ms | ms/round | round/plain | draft ms | verify ms | verify/plain "
        "| draft step/plain | mean accepted len | accept/pos | speedup vs plain | ours/transformers | same tokens "
        "| roofline | memory MB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    number = lambda value, form: "-" if value is None else format(value, form)
    for r in result["rows"]:
        impl = r["impl"] + (f" ({r['cache']} cache)" if "cache" in r else "")
        if result["meta"].get("invariance_cost") and "invariant" in r:
            impl += " (invariant)" if r["invariant"] else " (default numerics)"
        per_pos = ", ".join(f"{p:.2f}" for p in r["acceptance_per_position"]) or "-"
        same = "-" if r["same_tokens"] is None else ("yes" if r["same_tokens"] else "no")
        if "round_costs" in r:
            used = "/".join(str(n) for n in r["rounds_by_num_draft"])
            per_pos += f"; rounds with 0..{r['k']} drafts: {used} ({r['rest_rounds']} of the 0 rests"
            per_pos += f", {r['tree_rounds']} of the {r['k']} trees)" if r.get("tree") else ")"
        lines.append(
            f"| {impl} | {r['batch']} | {r['k']} | {r['tokens_per_second']:.1f} | {number(r['prefill_ms'], '.1f')} "
            f"| {number(r['ms_per_round'], '.1f')} | {number(r.get('round_over_plain'), '.2f')} "
            f"| {number(r.get('draft_ms'), '.2f')} | {number(r.get('verify_ms'), '.2f')} "
            f"| {number(r.get('verify_over_plain'), '.2f')} | {number(r.get('draft_step_over_plain'), '.2f')} "
            f"| {r['mean_accepted_length']:.2f} | {per_pos} | {r['speedup_vs_plain']:.2f}x "
            f"| {number(r['ours_over_peer'], '.2f')} | {same} | {number(r.get('roofline_fraction'), '.0%')} "
            f"| {number(r.get('memory_mb'), '.0f')} | {number(r['compile_seconds'], '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def report(args) -> int:
    result = run(args)
    table = refill_markdown(result) if args.refill else serve_markdown(result) if args.serve else markdown(result)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command = "python -m mtp_jax.bench " + shlex.join(argv)
    with compile_cache.active(args.no_compile_cache):
        return run_cli(report, args)
