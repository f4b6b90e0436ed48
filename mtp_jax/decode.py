"""python -m mtp_jax.decode: batch generation from prompts to JSONL, with MTP drafting when the model has a head.

Rows are written as their batch finishes: to stdout (as plain text, a block per prompt, when stdout is a terminal;
a lone prompt's answer there appears as it is generated, `text_stream.stream_prompt`), or to FILE.partial-<settings>
beside --out, renamed to --out when every row is there. A run that stops early keeps its finished rows there, and
--resume continues it.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from mtp_jax import checkpoint, compile_cache, default_drafting, stats
from mtp_jax.config import ACTIVATION_FORMATS, LAYER_LAYOUTS, WEIGHT_FORMATS, DecodeConfig
from mtp_jax.errors import UserError, exit_process, run_cli
from mtp_jax.files import nearest_existing_ancestor, write_atomically
from mtp_jax.hub import MODEL_HELP, names_a_model
from mtp_jax.models import causal_lm, cpu_rows
from mtp_jax.prompts import encode_prompts, read_prompt_records
from mtp_jax.quant import rounds_rows
from mtp_jax.sharding import make_mesh
from mtp_jax.text import batch_rows, check_budget, decode_batches, first_batch, row_sampling
from mtp_jax.text_stream import stream_prompt


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
    parser.add_argument("--adaptive", action="store_true", help="each round drafts 0..K tokens (K = --num-draft), "
                        "chosen on device from running acceptance and --round-costs")  # fmt: skip
    parser.add_argument("--round-costs", type=float_list, metavar="C0,...,CK", help="with --adaptive: time of a "
                        "round with 0..K drafts over a plain step, as python -m mtp_jax.bench measures them "
                        "(default: estimated from parameter bytes, right for memory-bound accelerators)")  # fmt: skip
    parser.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=DecodeConfig.invariant,
                        help="batch-invariant numerics: each row's tokens the same at any batch size, and greedy MTP "
                        "equal to plain decoding in bfloat16 too")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=non_negative_int, default=0)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=8)
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


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """--weights and --layer-layout: how the loaded model holds its weights (decode and bench)."""
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                        help="auto: as the checkpoint ships them (fp8 block-scaled weights stay fp8); bfloat16: "
                        "dequantized; int8 (per-channel scales) or fp8 (128x128 block scales): matmul weights stored "
                        "so, dequantized inside the step (about half the bytes of bfloat16 per step)")  # fmt: skip
    parser.add_argument("--layer-layout", choices=LAYER_LAYOUTS, default="auto",
                        help="layer parameters stacked (scanned) or unstacked (one array per layer; longer compiles); "
                        "auto: unstacked where a scan copies each layer's weights every step (GPU), else "
                        "stacked")  # fmt: skip
    parser.add_argument("--activations", choices=ACTIVATION_FORMATS, default="float",
                        help="int8: round the activations to int8 per block before each product with a 4-bit "
                        "weight (--weights int4, or a GGUF's Q4_1 blocks), as llama.cpp does: another model of the "
                        "same weights, faster on a CPU with AVX512-VNNI")  # fmt: skip


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
    platform = "cpu" if jax.default_backend() == "cpu" else "other"
    return default_drafting.DEFAULT_DRAFTS[platform]  # the most a round drafts: `default_decode_config` chooses


def check_output_path(path: str, option: str) -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, or one under a file."""
    if os.path.isdir(path):
        raise UserError(f"{option} {path}: is a folder")
    ancestor = nearest_existing_ancestor(path)
    if not os.path.isdir(ancestor):
        raise UserError(f"{option} {path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: cannot write in {ancestor}")


ROW_SETTINGS = ("model", "head", "dtype", "weights", "activations", "no_mtp", "num_draft", "adaptive", "round_costs",
                "invariant", "temperature", "top_p", "top_k", "max_new_tokens", "seed", "no_chat")  # fmt: skip


class RowOutput:
    """Where process 0 writes finished rows, batch by batch: stdout (JSONL, or `terminal_text` when it is a
    terminal), or `--out`'s partial file, renamed to `--out` by `finish`.

    The partial file, FILE.partial-<hash of the settings that shape rows>, holds whole rows in the output's format,
    in input order. A fresh run refuses to start beside one (its rows would be lost); --resume keeps its rows (or a
    complete FILE's) when they are those of this run's first prompts, and refuses one of other settings."""

    def __init__(self, args, prompts: list[str | list[int]]):
        self.file, self.kept, self.written = None, 0, 0
        self.terminal = args.out is None and sys.stdout.isatty()
        self.total = len(prompts)
        if args.out is None:
            return
        self.out = os.path.abspath(args.out)
        folder, name = os.path.split(self.out)
        os.makedirs(folder, exist_ok=True)
        settings = {k: getattr(args, k) for k in ROW_SETTINGS}
        settings.update({k: os.path.abspath(settings[k]) for k in ("model", "head") if settings[k] is not None})
        key = json.dumps(settings, sort_keys=True)
        self.partial = f"{self.out}.partial-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        partials = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith(f"{name}.partial-"))
        if partials and not args.resume:
            raise UserError(f"{partials[0]} holds the finished rows of an unfinished run: --resume continues it "
                            "(same settings); remove it to start over")  # fmt: skip
        if partials and self.partial not in partials:
            raise UserError(f"--resume: {partials[0]} was written with other settings (model, head, dtype, weights, "
                            "drafts, sampling, budget, seed or chat): rerun with those, or remove it")  # fmt: skip
        source = self.partial if partials else self.out if args.resume and os.path.isfile(self.out) else None
        rows, size = read_rows(source, prompts) if source else ([], 0)
        self.file = os.fdopen(os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o666), "r+b")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise UserError(f"{self.partial}: another decode is writing it") from None
        if source == self.out:
            with open(self.out, "rb") as f:
                self.file.write(f.read(size))
        self.file.truncate(size)  # a row cut short by a kill goes
        self.file.seek(size)
        self.kept = len(rows)
        if rows:
            print(f"resuming: {len(rows)} finished rows kept from {source}", file=sys.stderr)

    def write(self, rows: list[dict]) -> None:
        if self.terminal:
            lines = "".join(terminal_text(r, self.total) for r in rows)
        else:
            lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        if self.file is None:
            sys.stdout.write(lines)
            sys.stdout.flush()
        else:
            self.file.write(lines.encode("utf-8"))
            self.file.flush()
            os.fsync(self.file.fileno())
        self.written += len(rows)

    def show(self, text: str) -> None:
        """Part of a lone prompt's answer, on the terminal as it is generated (`text_stream.stream_prompt`)."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def shown(self, row: dict) -> None:
        """The lone prompt's answer has been shown piece by piece: end it as `terminal_text` ends a row."""
        sys.stdout.write("\n" if row["text"] else terminal_text(row, self.total))
        sys.stdout.flush()
        self.written += 1

    def finish(self) -> None:
        """Every row is written: the partial file becomes `--out`."""
        if self.file is not None:
            os.replace(self.partial, self.out)
            self.file.close()

    def abandon(self) -> str:
        """The run stops early: keep the partial file when it holds rows (said in the returned note), else remove it."""
        if self.file is None:
            return ""
        rows = self.kept + self.written
        self.file.close()
        if not rows:
            os.unlink(self.partial)
            return ""
        return f"{rows} finished rows kept in {self.partial}; rerun with --resume to continue"


def terminal_text(row: dict, total: int) -> str:
    """A row as a person reads it: the generated text (its token ids where it has none: no tokenizer), under a
    header line with the prompt's number and its start when there are several prompts."""
    answer = row["text"] or ("token ids: " + json.dumps(row["token_ids"]) if row["token_ids"] else "")
    if total == 1:
        return answer + "\n"
    prompt = row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])
    prompt = " ".join(prompt.split())
    prompt = prompt if len(prompt) <= 60 else prompt[:59] + "…"
    separator = "\n" if row["index"] > 0 else ""
    return f"{separator}=== [{row['index'] + 1}/{total}] {prompt} ===\n{answer}\n"


def read_rows(path: str, prompts: list[str | list[int]]) -> tuple[list[dict], int]:
    """The whole rows at the start of an output file, checked to be rows of `prompts` (texts or token ids) in order,
    and the bytes they take."""
    rows, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # cut short by a kill
            try:
                row = json.loads(line)
            except ValueError:
                raise UserError(f"--resume: {path} line {len(rows) + 1} is not an output row") from None
            i = len(rows)
            if not isinstance(row, dict) or set(row) != set(ROW_FIELDS) or row["index"] != i:
                raise UserError(f"--resume: {path} line {i + 1} is not row {i} of a decode output")
            if i >= len(prompts) or row["prompt"] != prompts[i]:
                raise UserError(f"--resume: {path} row {i} is not for prompt {i} of this run: remove the file to "
                                "start over")  # fmt: skip
            rows.append(row)
            size += len(line)
    return rows, size


ROW_FIELDS = ("index", "prompt", "text", "token_ids", "num_tokens", "finish_reason")


def open_output(args, prompts: list[str | list[int]], lead: bool) -> tuple[RowOutput | None, int]:
    """(process 0's RowOutput, else None; the rows already done, the same on every process)."""
    output = error = None
    if lead:
        try:
            output = RowOutput(args, prompts)
        except Exception as e:  # the other processes must not wait for a count that never comes
            error = e
    kept = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if error else output.kept if lead else 0)))
    if error is not None:
        raise error
    if kept < 0:
        raise UserError("process 0 could not open the output (its error says why)")
    return output, kept


def run(args) -> int:
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.model is not None and not names_a_model(args.model):
        raise UserError(f"{args.model}: no such model file or folder")
    if args.round_costs is not None and not args.adaptive:
        raise UserError("--round-costs goes with --adaptive")
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
    if lead and output.terminal and tokenizer is not None and len(prompts) - done == 1 and jax.process_count() == 1:
        result, summary = stream_prompt(model, tokenizer, prompts[done], decode_cfg, sampling, output.show)
        output.shown(result.row())
        return {"load_seconds": load_seconds, **summary, **drafting_note(args)}
    write = (lambda results: output.write([r.row() for r in results])) if lead else (lambda results: None)
    summary = decode_batches(model, tokenizer, prompts[done:], decode_cfg, batch_size, sampling, write, progress=lead)
    return {"load_seconds": load_seconds, **summary, **drafting_note(args)}


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
    invariant = cfg.invariant or rounds_rows(model)  # as `speculative.generate` decodes it
    max_draft = args.num_draft if args.adaptive else None
    drafting = default_drafting.choose(model, *batch, invariant, max_draft, adaptive=args.adaptive)
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


if __name__ == "__main__":
    exit_process(main())
