"""`python -m mtp_jax.bench --serve`: a load test of `python -m mtp_jax.serve`, through the `openai` client package.

For each drafting setting the server is started as a child process on a free port; `--clients` clients send
streaming chat completions of the held-out prompts (greedy, at most --max-new-tokens each), arriving as a Poisson
process of `--request-rate` requests a second (all at once by default), at most `--clients` in flight. Reported with
the names of vLLM's serving benchmark: requests/s, output tokens/s, time to first token (TTFT) and inter-token
latency (ITL: the gaps between a stream's chunks) at p50 / p99, and the share of this machine's cores the clients
took (they run here, beside the server). Beside each, the same prompts through the same
engine in this process, without HTTP (an `Engine` of the server's slots, positions and prefill chunk, every prompt
submitted at once): the rate the server is measured against. Both compile every program before they are timed
(`Engine.warm`; the server's `--warm greedy`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

from mtp_jax.bench.environment import header_lines, metadata
from mtp_jax.cli.bench_slots import held_out_prompts
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.engine import Engine, Request
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.runtime.errors import UserError

READY_SECONDS = 1800  # a server's load, conversion and warm compile of every insert (the first converts the model)


@dataclasses.dataclass
class StreamTiming:
    """One request's clock: sent, first chunk, later chunks; its output tokens (the usage the server reports)."""

    sent: float
    chunks: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, options: list[str], slots: int, max_len: int) -> tuple[subprocess.Popen, str]:
    """`python -m mtp_jax.serve` on a free port, once its /health answers: (process, base URL)."""
    port = free_port()
    command = [sys.executable, "-m", "mtp_jax.serve", "--port", str(port), "--slots", str(slots),
               "--max-len", str(max_len), *options]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if args.dtype:
        command += ["--dtype", args.dtype]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise UserError(f"the server exited ({server.returncode}): {server.stderr.read()[-2000:].strip()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return server, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise UserError(f"the server did not answer /health within {READY_SECONDS} s")


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def send(client, model: str, text: str, max_tokens: int) -> StreamTiming:
    """One streaming chat completion, timed chunk by chunk."""
    timing = StreamTiming(sent=time.perf_counter())
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            timing.chunks.append(time.perf_counter())
        if chunk.usage is not None:
            timing.output_tokens = chunk.usage.completion_tokens
    return timing


def load(base_url: str, texts: list[str], clients: int, rate: float, max_tokens: int) -> dict:
    """Send every prompt (Poisson arrivals at `rate` a second; inf: at once), `clients` at most in flight."""
    try:
        import openai  # the load test's client: a test extra, not a dependency of the library
    except ImportError:
        raise UserError("--serve drives the server through the openai package: pip install openai") from None

    local = threading.local()

    def client():
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
        return local.client

    model = client().models.list().data[0].id
    gaps = np.random.default_rng(0).exponential(1 / rate, len(texts)) if np.isfinite(rate) else np.zeros(len(texts))
    start, cpu_start = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = []
        for text, arrival in zip(texts, np.cumsum(gaps), strict=True):
            time.sleep(max(0.0, start + arrival - time.perf_counter()))
            futures.append(pool.submit(lambda text=text: send(client(), model, text, max_tokens)))
        timings = [f.result() for f in futures]
    wall = time.perf_counter() - start
    return {**summarize(timings, wall), "client_cpu_share": (time.process_time() - cpu_start) / wall / os.cpu_count()}


def summarize(timings: list[StreamTiming], wall: float) -> dict:
    """vLLM's serving metrics of a run's timings (milliseconds for latencies)."""
    ttft = np.asarray([(t.chunks[0] - t.sent) * 1e3 for t in timings if t.chunks])
    itl = np.concatenate([np.diff(t.chunks) * 1e3 for t in timings if len(t.chunks) > 1] or [np.zeros(0)])
    tokens = sum(t.output_tokens for t in timings)
    pick = lambda values, q: float(np.percentile(values, q)) if values.size else None
    return {
        "completed": len(timings),
        "output_tokens": tokens,
        "duration_s": wall,
        "request_throughput": len(timings) / wall,
        "output_throughput": tokens / wall,
        "median_ttft_ms": pick(ttft, 50),
        "p99_ttft_ms": pick(ttft, 99),
        "median_itl_ms": pick(itl, 50),
        "p99_itl_ms": pick(itl, 99),
    }


def offline_rate(model: CausalLM, prompts, cfg: DecodeConfig, slots: int, max_len: int, prefill_chunk: int) -> float:
    """Output tokens a second of the same prompts through an engine of the server's settings in this process, all
    submitted at once, its programs compiled before the clock starts (`warm`, as the server's)."""
    engine = Engine(model, cfg, slots=slots, max_len=max_len, prefill_chunk=prefill_chunk or None)
    engine.warm()
    for prompt in prompts:
        engine.submit(Request(prompt.token_ids, cfg.max_new_tokens))
    generated, start = 0, time.perf_counter()
    while engine.busy:
        generated += sum(len(update.tokens) for update in engine.step())
    return generated / (time.perf_counter() - start)


def run_serve(args, model: CausalLM, tokenizer, label: str, dtype: str, notes: list[str]) -> dict:
    """The load test for every --batch-sizes (the server's slots), without MTP and with --num-draft's largest k, each
    with prompts prefilled in chunks of --prefill-chunk tokens and with whole prompts."""
    if tokenizer is None:
        raise UserError("--serve sends the held-out text prompts: it needs a model with a tokenizer")
    if args.mesh or args.random_shape:
        raise UserError("--serve starts the server on one device with a checkpoint: no --mesh or --random-shape")
    prompts = held_out_prompts(model, tokenizer, args.prompts)
    texts = [p.text for p in prompts]
    max_len = max(len(p.token_ids) for p in prompts) + args.max_new_tokens
    drafts = sorted({0, max(args.num_draft)}) if model.config.has_mtp else [0]
    notes.append(f"the server and its clients share this machine's {os.cpu_count()} cores")
    rows = []
    runs = [(k, chunk) for k in drafts for chunk in dict.fromkeys((args.prefill_chunk, 0))]  # 0: whole prompts
    for slots in args.batch_sizes:
        for k, chunk in runs:
            options = ["--no-mtp"] if k == 0 else ["--num-draft", str(k)]
            options += ["--prefill-chunk", str(chunk), "--warm", "greedy"]  # compiles apart, as the offline rate's
            server, base_url = start_server(args, options, slots, max_len)
            try:
                served = load(base_url, texts, args.clients, args.request_rate, args.max_new_tokens)
            finally:
                stop_server(server)
            cfg = DecodeConfig(num_draft=k, max_new_tokens=args.max_new_tokens)
            offline = offline_rate(model, prompts, cfg, slots, max_len, chunk)
            row = {
                "slots": slots,
                "k": k,
                "prefill_chunk": chunk,
                "clients": args.clients,
                "request_rate": args.request_rate,
                **served,
                "offline_output_throughput": offline,
                "served_over_offline": served["output_throughput"] / offline,
            }
            rows.append(row)
            print(f"serve: {slots} slots, k={k}: {served['output_throughput']:.1f} output tokens/s "
                  f"({offline:.1f} offline)", file=sys.stderr, flush=True)  # fmt: skip
    meta = metadata(args, label, dtype, notes, model)
    meta["prompts"] = f"{len(prompts)} held-out prompts (eval_prompts.jsonl, cycled), chat completions, streamed"
    return {"meta": meta, "rows": rows}


def serve_markdown(result: dict) -> str:
    meta = result["meta"]
    number = lambda value: "-" if value is None else f"{value:.0f}"
    lines = [
        *header_lines(meta),
        f"- model: {meta['model']} ({meta['dtype']}); prompts: {meta['prompts']}; at most {meta['max_new_tokens']} "
        "new tokens each, greedy",
        *(f"- note: {note}" for note in meta["notes"]),
        "",
        "| slots | k | prefill chunk | clients | req/s | output tok/s | offline tok/s | served/offline | TTFT p50 ms "
        "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | clients' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['slots']} | {r['k']} | {r['prefill_chunk'] or 'whole prompts'} | {r['clients']} "
            f"| {r['request_throughput']:.2f} "
            f"| {r['output_throughput']:.1f} | {r['offline_output_throughput']:.1f} | {r['served_over_offline']:.2f} "
            f"| {number(r['median_ttft_ms'])} | {number(r['p99_ttft_ms'])} | {number(r['median_itl_ms'])} "
            f"| {number(r['p99_itl_ms'])} | {r['client_cpu_share']:.0%} |"
        )
    return "\n".join(lines) + "\n"
