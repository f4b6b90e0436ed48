"""Where a decode round's time goes, for the benchmark: the draft steps, the verify pass and the whole round, each
timed as its own jitted call of the loop's own shapes, and the bytes a plain step must read against the device's
copy bandwidth (the roofline).

Each part runs `iterations` times inside one `fori_loop`, carrying the buffers it updates (KV or MTP cache, or the
whole loop state), so they are updated in place as in the real loop and the call's dispatch is amortised. Rounds are
greedy; the state comes from the loop's own prefill of the benchmark's prompts. The verify part makes every
position's logits (a whole round, where its plan says `row_by_row`, makes them only while a draft is accepted).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.config.execution_plan import VerifyLogits
from mtp_jax.decode.adaptive import probe_cycle, step_param_bytes
from mtp_jax.decode.loop_state import mtp_block_width
from mtp_jax.decode.prefill import prefill
from mtp_jax.decode.rounds import Round, RoundKind, draft, round_context, run_round, verify
from mtp_jax.decode.speculative import tracing
from mtp_jax.decode.tree import run_tree_round
from mtp_jax.kernels import traced_plan
from mtp_jax.models.kv_cache import cache_slots


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "slots"))
def prefilled_state(graphdef, params, prompt_ids, prompt_lens, cfg: DecodeConfig, slots: int):
    """The decode loop's state after a greedy prefill of the prompts (ids [B, W], lens [B]), EOS stopping no row,
    with caches of `slots`."""
    model = nnx.merge(graphdef, params)
    row_keys = jax.random.split(jax.random.key(0), prompt_ids.shape[0])
    eos = jnp.zeros((0,), jnp.int32)
    with tracing(model, cfg):
        return prefill(model, cfg, None, eos, prompt_ids, prompt_lens, row_keys, slots)


def prefill_program(split_model, prompt_ids, prompt_lens, cfg: DecodeConfig):
    """A call running the decode loop's prefill alone, with its shapes (cache slots for `cfg`), compiled and warmed
    up; greedy (sampling the first token instead costs the same to within one row of draws)."""
    graphdef, params = split_model
    ids, lens = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_lens, jnp.int32)
    run = functools.partial(prefilled_state, graphdef, params, ids, lens, cfg, cache_slots(ids.shape[1], cfg))
    jax.block_until_ready(run())
    return run


def timed_round(cfg: DecodeConfig, num_draft: int) -> Round:
    """The round that drafts `num_draft` in a loop drafting at most cfg.num_draft: with none, a probe when the loop
    has an MTP layer, else a plain step."""
    if num_draft:
        return Round(RoundKind.DRAFT, num_draft)
    return Round(RoundKind.PROBE) if cfg.num_draft else Round(RoundKind.PLAIN)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "part", "num_draft", "iterations"))
def repeat_part(graphdef, params, state, cfg: DecodeConfig, part: str, num_draft: int, iterations: int):
    """`part` of a round with `num_draft` drafts ("round", "verify", "draft", or an adaptive loop's resting "cycle"),
    or cfg's draft tree's whole round ("tree"), run `iterations` times from `state`, carrying what it updates (the
    state, or the trunk or MTP cache), under the decode's mesh rules and execution plan."""
    model = nnx.merge(graphdef, params)
    with tracing(model, cfg):
        return _repeated(model, state, cfg, part, num_draft, iterations)


def _repeated(model, state, cfg: DecodeConfig, part: str, num_draft: int, iterations: int):
    eos = jnp.zeros((0,), jnp.int32)
    timed = Round(RoundKind.TREE, cfg.num_draft, cfg.tree) if part == "tree" else timed_round(cfg, num_draft)
    ctx = round_context(model, cfg, None, eos, [timed])
    step = functools.partial(run_tree_round if part == "tree" else run_round, ctx, timed)
    if part in ("round", "tree"):
        return jax.lax.fori_loop(0, iterations, lambda _, s: step(s), state)
    if part == "cycle":  # an adaptive loop at rest: rests until its MTP block is full, then a probe (step, j = 0)
        rest_step = functools.partial(run_round, ctx, Round(RoundKind.REST))
        cycle = lambda _, s: step(jax.lax.fori_loop(0, mtp_block_width(cfg) - 1, lambda _, t: rest_step(t), s))
        return jax.lax.fori_loop(0, iterations, cycle, state)
    if part == "verify":
        drafts = jnp.zeros((state.pending.shape[0], num_draft), jnp.int32)  # [B, j]: the values do not matter
        active = jnp.ones(state.pending.shape, bool)
        # every position's logits, as if every draft were accepted: row by row (`VerifyLogits`), these drafts'
        # verify would stop at the first
        whole_block = dataclasses.replace(cfg.plan, verify_logits=VerifyLogits.BLOCK) if cfg.plan else None
        ctx = round_context(model, dataclasses.replace(cfg, plan=whole_block), None, eos, [timed])

        def verify_step(_, carry):  # the trunk pass, lm_head and acceptance; recurrent states kept (hybrid trunks)
            cache, tokens = carry
            verdict = verify(ctx, state, drafts, None, cache)
            # the emitted tokens are carried: without a use, XLA drops the logits of a dense trunk as dead code
            kept = model.keep_verified(cache, verdict.cache, verdict.accepted, active)
            return kept, tokens + verdict.token + verdict.accepted

        return jax.lax.fori_loop(0, iterations, verify_step, (state.cache, jnp.zeros_like(state.pending)))

    def draft_step(_, carry):  # the MTP layer's passes and the draft head
        mtp_cache, tokens = carry
        drafts = draft(ctx, timed, state.replace(mtp_cache=mtp_cache))
        # the drafts are carried: without a use, XLA drops the draft head and all of the MTP layer but its cache
        # entries as dead code
        return drafts.mtp_cache, tokens + jnp.sum(drafts.tokens, axis=1) + drafts.first

    return jax.lax.fori_loop(0, iterations, draft_step, (state.mtp_cache, jnp.zeros_like(state.pending)))


class RoundTimer:
    """Times round parts of one model on one padded prompt batch (ids [B, W], lens [B])."""

    def __init__(self, model, prompt_ids, prompt_lens, max_new_tokens: int, invariant: bool = False,
                 iterations: int = 16, repeats: int = 3):  # fmt: skip
        self.graphdef, self.params = nnx.split(model)
        self.ids, self.lens = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_lens, jnp.int32)
        self.max_new_tokens, self.iterations, self.repeats = max_new_tokens, iterations, repeats
        self.invariant = invariant  # the numerics of the rounds timed (DecodeConfig.invariant)
        self.plan = traced_plan.resolve(model.sharding_rules, invariant)  # as `generate` resolves it
        self._states = {}

    def _state(self, cfg: DecodeConfig):
        if cfg not in self._states:
            slots = cache_slots(self.ids.shape[1], cfg)
            self._states[cfg] = prefilled_state(self.graphdef, self.params, self.ids, self.lens, cfg, slots)
        return self._states[cfg]

    def _part(self, part: str, max_draft: int, num_draft: int, adaptive: bool = False, tree: int = 0,
              tree_width: int = 4) -> tuple:  # fmt: skip
        """A compiled, warmed-up call running `part` ("round", "verify", "draft", an adaptive loop's resting "cycle",
        or a "tree" round) with `num_draft` drafts, in a loop whose most drafts are `max_draft` (adaptive: with its
        wider MTP block; `tree`, `tree_width`: with that draft tree's); and the number of rounds the call runs:
        `iterations`, or that many cycles' rounds."""
        cfg = DecodeConfig(num_draft=max_draft, max_new_tokens=self.max_new_tokens, stop_on_eos=False,
                           adaptive=adaptive, invariant=self.invariant, tree=tree, tree_width=tree_width,
                           plan=self.plan)  # fmt: skip
        iterations = max(1, self.iterations // mtp_block_width(cfg)) if part == "cycle" else self.iterations
        state = self._state(cfg)
        run = functools.partial(repeat_part, self.graphdef, self.params, state, cfg, part, num_draft, iterations)
        jax.block_until_ready(run())
        return run, iterations * (mtp_block_width(cfg) if part == "cycle" else 1)

    def round_program(self, num_draft: int) -> tuple:
        """A fixed-k loop's round as `split` times it: the compiled, warmed-up call, the rounds it runs, and the
        compiled program's text (`bench.call_profile` names its calls from it)."""
        run, rounds = self._part("round", num_draft, num_draft)
        return run, rounds, repeat_part.lower(*run.args).compile().as_text()  # the arguments `run` calls it with

    def milliseconds(self, parts: list[tuple]) -> list[float]:
        """Time per round of each (part, max_draft, num_draft[, adaptive]), in ms. The parts are timed in turn,
        `repeats` times over, and each keeps its fastest: interference from the rest of the machine only ever adds
        time, and turns taken in one sweep see the same machine, so ratios between the parts hold up on a busy
        host."""
        runs = [self._part(*part) for part in parts]
        best = [math.inf] * len(runs)
        for _ in range(self.repeats):
            for i, (run, _) in enumerate(runs):
                start = time.perf_counter()
                jax.block_until_ready(run())
                best[i] = min(best[i], time.perf_counter() - start)
        return [1000 * wall / rounds for wall, (_, rounds) in zip(best, runs, strict=True)]

    def split(self, num_draft: int) -> dict:
        """A fixed-k loop's round: its whole time and its draft and verify parts, in ms."""
        parts = [("round", num_draft, num_draft), ("verify", num_draft, num_draft)]
        times = self.milliseconds(parts + ([("draft", num_draft, num_draft)] if num_draft else []))
        return {"round_ms": times[0], "verify_ms": times[1], "draft_ms": times[2] if num_draft else 0.0}

    def fixed_rounds(self, max_draft: int) -> tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
        """(the time of a fixed-k loop's round over a plain one for k = 0..max_draft, timed in the same sweeps; per
        depth, the drafts judged and accepted in the max_draft loop's rounds as timed, greedy from the prompts)."""
        parts = [("round", k, k) for k in range(max_draft + 1)]
        plain, *rounds = self.milliseconds(parts)
        costs = np.maximum.accumulate(np.maximum(np.asarray([plain, *rounds]) / plain, 1.0))
        run, _ = self._part(*parts[-1])
        stats = jax.device_get(run().stats)
        judged, accepted = (tuple(int(n) for n in counts) for counts in (stats.reached, stats.accepted_at))
        return tuple(float(c) for c in costs), judged, accepted

    def adaptive_costs(self, max_draft: int, tree: int = 0, tree_width: int = 4) -> tuple[float, ...]:
        """An adaptive loop's `round_costs`, over a plain loop's round (timed in the same sweeps): rounds with j =
        1..max_draft drafts as the loop runs them (right after a probe or a drafting round, so over a narrow MTP
        block), and for j = 0 the probe as it comes while resting: after rests filled the block, so catching the MTP
        layer up over all of it; with a `tree` budget, then its round (`tree_width` wide, max_draft deep). The
        probe's cost is read off a whole resting cycle (C - 1 rests and the probe, C = the block width) less C - 1
        plain steps, so whatever rests cost beyond a plain step is charged to it and `rest_value` gets the cycle's
        time exactly. A drafting round does all the work of one with fewer drafts, so timing noise that says
        otherwise is evened out: each cost is at least 1 and j >= 1 at least the one before (the tree's at least
        1)."""
        loop = (True, tree, tree_width)  # every adaptive part in the loop's own shapes
        drafting_parts = [("round", max_draft, j, *loop) for j in range(1, max_draft + 1)]
        tree_parts = [("tree", max_draft, max_draft, *loop)] if tree else []
        plain, cycle, *rounds = self.milliseconds([("round", 0, 0), ("cycle", max_draft, 0, *loop), *drafting_parts,
                                                   *tree_parts])  # fmt: skip
        width = probe_cycle(max_draft)
        probe = max(width * cycle / plain - (width - 1), 1.0)
        drafting = np.maximum.accumulate(np.maximum(np.asarray(rounds[:max_draft]) / plain, 1.0))
        trees = [max(rounds[-1] / plain, 1.0)] if tree else []
        return (float(probe), *(float(c) for c in drafting), *(float(c) for c in trees))


def plain_step_bytes(model, batch: int, slots: int) -> int:
    """Bytes a plain decode step must read: the trunk's parameters and the whole padded cache (attention reads
    every slot)."""
    trunk_bytes, _ = step_param_bytes(model)
    cache = jax.eval_shape(lambda: model.new_cache(batch, slots))
    return trunk_bytes + sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def read_bandwidth(num_bytes: int, repeats: int = 5) -> float:
    """A CPU's streaming read bandwidth in bytes/s: `num_bytes` read once, split over as many threads as it has
    cores (numpy's reductions let go of the GIL), the fastest of `repeats` passes. What a decode step's weights
    can be read at, where XLA's elementwise copy (`copy_bandwidth`) runs on fewer threads."""
    data = np.ones(num_bytes // 8, np.uint64)
    parts = np.array_split(data, os.cpu_count() or 1)
    best = math.inf
    for _ in range(repeats):
        threads = [threading.Thread(target=np.bitwise_xor.reduce, args=(part,)) for part in parts]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def copy_bandwidth(num_bytes: int, repeats: int = 5) -> float:
    """Measured device memory bandwidth in bytes/s: an elementwise pass reading and writing `num_bytes`."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    touch = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(touch(x))
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(touch(x))
        walls.append(time.perf_counter() - start)
    return 2 * x.size * 4 / min(walls)  # the fastest pass: interference only slows one down
