"""Timing our decoding for the benchmark: the programs compiled once, their runs interleaved with the peers' so that
a machine's drift touches every column alike, and the memory bandwidth that bounds a step."""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from mtp_jax.bench.peers import per_round
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.round_timing import RoundTimer, copy_bandwidth, plain_step_bytes, prefill_program, read_bandwidth
from mtp_jax.decode.speculative import compile_generate
from mtp_jax.decode.stats import add, summarize
from mtp_jax.models.kv_cache import cache_slots


class OursRun:
    """One configuration of ours, compiled ahead of time (timed apart); each call runs it once and returns the wall
    seconds, and times the prefill alone (same shapes) before it; `result` gives the row fields from the fastest of
    the given walls and the generated tokens."""

    def __init__(self, model, ids, lens, cfg):
        self.model, self.ids, self.lens, self.cfg, self.key = model, ids, lens, cfg, jax.random.key(0)
        start = time.perf_counter()
        self.compiled = compile_generate(model, ids, lens, self.key, cfg)
        self.compile_seconds = time.perf_counter() - start
        self.prefill = prefill_program(nnx.split(model), ids, lens, cfg)
        self.prefill_walls: list[float] = []
        self.out = None

    def __call__(self) -> float:
        start = time.perf_counter()
        jax.block_until_ready(self.prefill())
        self.prefill_walls.append(time.perf_counter() - start)
        start = time.perf_counter()
        self.out = jax.block_until_ready(self.compiled(self.model, self.ids, self.lens, self.key, self.cfg))
        return time.perf_counter() - start

    def result(self, walls: list[float]) -> tuple[dict, np.ndarray]:
        out, wall, memory = self.out, min(walls), self.compiled.memory_bytes()
        tokens = int(np.sum(out.lengths))
        summary = summarize(add(None, out.stats), num_draft=self.cfg.num_draft, tree=self.cfg.tree, wall=wall,
                            generated_tokens=tokens, compile_seconds=self.compile_seconds)  # fmt: skip
        del summary["device"], summary["num_draft"]
        return {**summary, "walls": walls, **per_round(wall, min(self.prefill_walls), summary["rounds"]),
                "memory_mb": None if memory is None else memory / 2**20}, np.asarray(out.tokens)  # fmt: skip


def interleaved_walls(runs: list, repeats: int) -> list[list[float]]:
    """Wall seconds [run][repeat]: every run once per sweep, `repeats` sweeps, so that a slow spell of the machine
    (other load, clocks) costs all configurations alike rather than whichever was running then. Sweeps alternate
    their order (forward, backward, ...): a place in the sweep that is slower or faster (the first run after the
    previous sweep's last, a drifting clock) then falls on no configuration more than on another."""
    walls = [[] for _ in runs]
    for sweep in range(repeats):
        order = list(zip(runs, walls, strict=True))
        for run, times in order if sweep % 2 == 0 else order[::-1]:
            times.append(run())
    return walls


def time_batch(args, model, ids, lens, drafts: list[int], bandwidth: float | None, peers=()):
    """Rows (fields, tokens) for one padded batch: ours for each k in `drafts`, then the adaptive loop, then draft
    trees of each budget in args.tree (as deep as the largest k; with --adaptive, each also as a choice of the
    adaptive loop), then the peers (`peers`: (name, run) pairs),
    timed in interleaved sweeps; with --split, each fixed k with its round's parts and the plain rows with their
    roofline fraction."""
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_on_eos=False,
                    invariant=args.invariant)  # fmt: skip
    timer = RoundTimer(model, ids, lens, args.max_new_tokens, args.invariant) if args.split else None
    rows, runs = [], []
    for k in drafts:
        cfg = DecodeConfig(num_draft=k, **settings)
        row = {"impl": "mtp_jax", "batch": len(ids), "k": k, "invariant": args.invariant}
        if timer is not None:
            row.update(timer.split(k))
        if timer is not None and k == 0:
            row["bytes_per_step"] = plain_step_bytes(model, len(ids), cache_slots(ids.shape[1], cfg))
        rows.append(row)
        runs.append(OursRun(model, ids, lens, cfg))
    if timer is not None and args.adaptive and max(drafts) > 0:
        costs = timer.adaptive_costs(max(drafts))
        cfg = DecodeConfig(num_draft=max(drafts), adaptive=True, round_costs=costs, **settings)
        adaptive = {"impl": "mtp_jax adaptive", "batch": len(ids), "k": max(drafts), "invariant": args.invariant}
        rows.append({**adaptive, "round_costs": list(costs)})
        runs.append(OursRun(model, ids, lens, cfg))
    for budget in args.tree:  # draft trees, as deep as the longest chain; adaptive among them and the chains
        depth, width = max(drafts), args.tree_width
        cfg = DecodeConfig(num_draft=depth, tree=budget, tree_width=width, **settings)
        impl = f"mtp_jax tree N={budget} W={width}"
        rows.append({"impl": impl, "batch": len(ids), "k": depth, "tree": budget, "invariant": args.invariant})
        runs.append(OursRun(model, ids, lens, cfg))
        if timer is not None and args.adaptive:
            costs = timer.adaptive_costs(depth, budget, width)
            cfg = DecodeConfig(num_draft=depth, adaptive=True, round_costs=costs, tree=budget, tree_width=width,
                               **settings)  # fmt: skip
            rows.append({"impl": f"mtp_jax adaptive, tree N={budget} W={width}", "batch": len(ids), "k": depth,
                         "tree": budget, "invariant": args.invariant, "round_costs": list(costs)})  # fmt: skip
            runs.append(OursRun(model, ids, lens, cfg))
    for k in drafts if args.invariance_cost else ():  # the other numerics, whole decodes only
        cfg = DecodeConfig(num_draft=k, **{**settings, "invariant": not args.invariant})
        rows.append({"impl": "mtp_jax", "batch": len(ids), "k": k, "invariant": not args.invariant})
        runs.append(OursRun(model, ids, lens, cfg))
    for name, peer_run in peers:
        rows.append({"impl": name, "batch": len(ids), "k": 0})
        runs.append(peer_run)
    results = []
    for row, run, walls in zip(rows, runs, interleaved_walls(runs, args.repeats), strict=True):
        fields, tokens = run.result(walls)
        row.update(fields)
        if "bytes_per_step" in row:
            row["roofline_fraction"] = row["bytes_per_step"] / (row["round_ms"] / 1000) / bandwidth
        results.append((row, tokens))
    return results


def measured_bandwidth() -> float:
    """Memory bandwidth of the first device, bytes/s: a CPU's streaming read over every core (512 MiB), an
    accelerator's copy (1 GiB)."""
    return read_bandwidth(2**29) if jax.devices()[0].platform == "cpu" else copy_bandwidth(2**30)


def ratio(part: float | None, whole: float | None, steps: int = 1) -> float | None:
    """part / steps / whole, or None when a side was not measured (or there are no steps)."""
    return None if part is None or not whole or not steps else part / steps / whole
