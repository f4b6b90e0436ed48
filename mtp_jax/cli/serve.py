"""python -m mtp_jax.serve: an OpenAI-compatible HTTP server (completions and chat completions, streamed or whole)
over one `Engine` whose slots every client shares.

Startup: the socket is bound (a port in use is refused at once), the model loads, and one tiny greedy request runs
through the engine, so its first insert and rounds compile before the server says it is ready (one line on stderr).
Other shapes compile when they first come, in that request's latency: a prompt width past the warm-up's bucket (16,
24, 32, 48, ... tokens), a number of requests joining at once (1, 2, 4, ... up to the slots), the first sampled
request (temperature > 0). The persistent compilation cache keeps them for later starts.

SIGTERM (or Ctrl-C): no new requests (the socket closes; 503 on open connections), running ones finish (cancelled
past --shutdown-grace), the engine's thread stops, status 0; before the server is ready, it exits at once with 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
import time

import uvicorn

from mtp_jax.cli.arguments import add_storage_arguments, add_tree_arguments, float_list, non_negative_int, positive_int
from mtp_jax.cli.decode import check_model_and_drafting, choose_num_draft, default_decode_config, note_without_kernel
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.engine import PREFILL_CHUNK, Engine
from mtp_jax.decode.prompts import encode_prompts
from mtp_jax.decode.text import batch_rows, first_batch
from mtp_jax.decode.tree import check_tree_model
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.loading import checkpoint
from mtp_jax.loading.default_model import GGUF_ENV, GGUF_NAME
from mtp_jax.loading.hub import MODEL_HELP
from mtp_jax.models import causal_lm
from mtp_jax.parallel.sharding import make_mesh
from mtp_jax.quant.int8_activations import has_int8_activations
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.errors import OneLineParser, UserError, run_cli
from mtp_jax.serve.app import MAX_BODY_BYTES, Served, create_app
from mtp_jax.serve.inputs import Limits
from mtp_jax.serve.metrics import Metrics
from mtp_jax.serve.server import Server, bind, url
from mtp_jax.serve.worker import Worker, warm_up

DEFAULT_MAX_LEN = 2048  # positions a slot holds by default (at most the model's context)
API_KEY_ENV = "MTP_JAX_API_KEY"
QUANTIZATION_SUFFIX = re.compile(r"[.-](I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)  # GGUF files' naming habit
SAMPLE_PROMPTS = ("Hello!", "Name three colours.", "What is the capital of France?", "Write a haiku about the sea.")


class Stopped(BaseException):  # not an Exception: no `except Exception` on the way swallows it
    """SIGTERM before the server was ready."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m mtp_jax.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"{MODEL_HELP} (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--head", help="MTP head folder from train_head (default: the model's own or shipped head)")
    parser.add_argument("--served-model-name", help="the model's id in the API (default: --model as given, or the "
                        "default model's name)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine)")
    parser.add_argument("--port", type=non_negative_int, default=8000, help="port (0: a free one; default 8000)")
    parser.add_argument("--slots", type=positive_int, default=8, help="requests decoded at once (default 8)")
    parser.add_argument("--prefill-chunk", type=non_negative_int, default=PREFILL_CHUNK, metavar="TOKENS",
                        help="prompts longer than this are prefilled this many tokens at a time, between rounds of "
                        f"the running requests (0: each prompt at once; default {PREFILL_CHUNK})")  # fmt: skip
    parser.add_argument("--max-len", type=positive_int, help="positions a slot holds, prompt and answer together "
                        f"(default: the model's context, at most {DEFAULT_MAX_LEN})")  # fmt: skip
    parser.add_argument("--num-draft", type=non_negative_int, help="drafts per round (default: the drafting that "
                        "pays on this device, as decode chooses it)")  # fmt: skip
    parser.add_argument("--no-mtp", action="store_true", help="plain decoding (k = 0)")
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="each round drafts 0..K tokens (K = --num-draft) or, with --tree, a draft tree",
    )
    parser.add_argument("--round-costs", type=float_list, metavar="C0,...,CK", help="with --adaptive: time of a "
                        "round with 0..K drafts (then, with --tree, a tree round) over a plain step")  # fmt: skip
    add_tree_arguments(parser)
    parser.add_argument("--warm", choices=("none", "greedy", "all"), default="none",
                        help="compile at start every program requests can run (each prompt-width bucket, for greedy "
                        "requests or for all), instead of at a bucket's first request; minutes on a CPU, less once "
                        "the compilation cache holds them (default: none)")  # fmt: skip
    parser.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=DecodeConfig.invariant,
                        help="batch-invariant numerics: a request's tokens whatever shares the slots")  # fmt: skip
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--mesh", help="shard over devices: data=D,model=M[,expert=E] or auto (all on model)")
    add_storage_arguments(parser)
    parser.add_argument("--api-key", help=f"ask clients for 'Authorization: Bearer KEY' (also ${API_KEY_ENV})")
    parser.add_argument("--max-body-bytes", type=positive_int, default=MAX_BODY_BYTES,
                        help=f"largest request body (default {MAX_BODY_BYTES})")  # fmt: skip
    parser.add_argument("--shutdown-grace", type=non_negative_int, default=30, metavar="SECONDS", help="at SIGTERM, "
                        "time running requests get to finish before they are cancelled (default 30)")  # fmt: skip
    parser.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning",
                        help="uvicorn's log level (default: warning)")  # fmt: skip
    parser.add_argument("--access-log", action="store_true", help="log each request (uvicorn's access log)")
    compile_cache.add_argument(parser)
    return parser


def run(args) -> int:
    check_arguments(args)
    sock = bind(args.host, args.port)
    previous = signal.signal(signal.SIGTERM, stop_starting)
    try:
        served = start(args)
    except Stopped:  # ends the process at once: a compile cut short leaves XLA objects that crash a normal exit
        print("mtp_jax.serve: stopped (SIGTERM) before it was ready", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        serve(args, served, sock)
    finally:
        served.worker.close()
    print("mtp_jax.serve: stopped", file=sys.stderr)
    return 0


def stop_starting(sig, frame):
    raise Stopped()


def check_arguments(args) -> None:
    check_model_and_drafting(args)
    if args.port > 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None


def start(args) -> Served:
    """Load the model, build and warm up the engine, start its worker: what the app serves."""
    cpu_rows.prepare()  # a first run builds the CPU's row kernel while the model loads
    try:
        mesh = make_mesh(args.mesh) if args.mesh else None
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    model, tokenizer = checkpoint.load(
        args.model, dtype=args.dtype, head=args.head, mesh=mesh, weights=args.weights, activations=args.activations
    )
    if tokenizer is None:
        raise UserError("this model has no tokenizer: the server needs one (it takes and answers text)")
    model = causal_lm.hold_for_platform(model, args.layer_layout)
    if model.sharding_rules is None:
        note_without_kernel()
    context = model.config.max_position_embeddings
    max_len = args.max_len or min(context, DEFAULT_MAX_LEN)
    if not 2 <= max_len <= context:
        raise UserError(f"--max-len must be in [2, {context}] (the model's context), got {max_len}")
    chat = bool(getattr(tokenizer, "chat_template", None))
    samples = encode_prompts(list(SAMPLE_PROMPTS), tokenizer, chat=chat, vocab_size=model.config.vocab_size,
                             context=context)  # fmt: skip
    cfg = engine_config(args, model, samples)
    try:
        engine = Engine(model, cfg, slots=args.slots, max_len=max_len, prefill_chunk=args.prefill_chunk or None)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.warm != "none":
        began = time.perf_counter()
        programs = engine.warm(sampled=args.warm == "all")
        print(f"mtp_jax.serve: {programs} programs warm in {time.perf_counter() - began:.0f} s", file=sys.stderr,
              flush=True)  # fmt: skip
    baseline = warm_up(engine, samples[0].token_ids[: max_len - 1], max_tokens=1)
    name = args.served_model_name or args.model or default_model_name()
    metrics = Metrics(name)
    worker = Worker(engine, tokenizer, metrics, baseline)
    worker.start()
    return Served(worker, tokenizer, name, Limits(max_len, model.config.vocab_size, context), metrics)


def engine_config(args, model, samples) -> DecodeConfig:
    """The engine's drafting, as decode chooses it (where the options leave it open: timed on sample prompts in a
    batch of the slots' size, once per model and device)."""
    num_draft = choose_num_draft(args, model.config.has_mtp)
    if args.adaptive and num_draft == 0:
        raise UserError("--adaptive needs drafts: a model with an MTP head and --num-draft > 0")
    try:
        cfg = DecodeConfig(num_draft=num_draft, adaptive=args.adaptive, round_costs=args.round_costs,
                           invariant=args.invariant, tree=args.tree if num_draft else 0,
                           tree_width=args.tree_width)  # fmt: skip
    except ValueError as e:
        raise UserError(str(e)) from None
    if cfg.tree:
        try:
            invariant = cfg.invariant or has_int8_activations(model)
            check_tree_model(model, dataclasses.replace(cfg, invariant=invariant))
        except ValueError as e:
            raise UserError(f"--tree: {e}") from None
    cfg = default_decode_config(args, model, cfg, first_batch(samples, batch_rows(model, args.slots, args.slots)))
    if args.drafting:
        print(f"mtp_jax.serve: drafting chosen: {args.drafting}", file=sys.stderr)
    return cfg


def default_model_name() -> str:
    """The default model's name: its GGUF file's (`$MTP_JAX_DEFAULT_GGUF` or the packaged one), without the
    quantization and extension ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    stem = os.path.basename(os.environ.get(GGUF_ENV) or GGUF_NAME).removesuffix(".gguf")
    return QUANTIZATION_SUFFIX.sub("", stem)


def describe_drafting(cfg: DecodeConfig) -> str:
    if cfg.num_draft == 0:
        return "no drafts"
    if cfg.tree:
        tree = f"a draft tree of {cfg.tree} nodes, depth {cfg.num_draft}"
        return f"adaptive drafting among chains and {tree}" if cfg.adaptive else tree
    return f"adaptive drafting, up to {cfg.num_draft} a round" if cfg.adaptive else f"{cfg.num_draft} drafts a round"


def serve(args, served: Served, sock) -> None:
    """Serve until SIGTERM (or Ctrl-C)."""
    app = create_app(served, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_grace)  # fmt: skip
    engine = served.worker.engine
    ready = (f"mtp_jax.serve: ready on {url(sock)} (model {served.model_name}, {engine.slots} slots of "
             f"{engine.max_len} positions, {describe_drafting(engine.cfg)})")  # fmt: skip

    def stopping():
        served.draining = True

    Server(config, on_ready=lambda: print(ready, file=sys.stderr, flush=True), on_stop=stopping).run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with compile_cache.active(args.no_compile_cache):
        return run_cli(run, args)
