"""The drafting a decode gets when it names none (`decode` without --num-draft, `generate_text` without a config):
drafting that pays on the device it runs on, and one line saying what was chosen and why.

- No MTP head: plain decoding.
- An accelerator, a dense model: DEFAULT_DRAFTS["other"] drafts a round. A verify pass of a few rows there is a
  read of the weights, about one plain step (measured: docs/benchmarks.md#h200), so each accepted draft is a step
  saved.
- An accelerator, a mixture of experts: a verify pass of B (k + 1) rows routes to more distinct experts than a
  plain step's B rows, and reads them (kernels/routed_kernel.py), so a round can cost well over a plain step
  (routed_floor.py; `plan` reports the ratio): its rounds are timed and chosen as on a CPU, up to
  DEFAULT_DRAFTS["other"] drafts.
- A CPU: a verify pass costs more than a plain step in proportion to its rows (the row kernel's sums are compute,
  not only reads), by how much depends on the CPU's ISA level, its cores and the model. So whole decodes with k =
  0 .. DEFAULT_DRAFTS["cpu"] drafts a round are timed here on the decode's own first prompts (`timed_decodes`: the
  programs a decode runs, prefill and loop bookkeeping included, not a round's parts), with the head's acceptance
  on them, once per model, kernel build, batch size and numerics, kept in the package's cache folder
  (`round_costs.json` in `~/.cache/mtp_jax` or $MTP_JAX_CACHE); the k with the most tokens per unit of time is
  taken where it beats plain decoding by MARGIN, else plain decoding (k = 0: no MTP layer run at all).
`--adaptive` without `--round-costs` on a CPU gets its round costs timed the same way (`measured(..., "adaptive")`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.adaptive import drafting_can_pay, expected_tokens
from mtp_jax.decode.round_timing import RoundTimer
from mtp_jax.decode.speculative import compile_generate
from mtp_jax.kernels.cpu import cpu_rows, kernel_build
from mtp_jax.runtime.cache_folder import cache_dir
from mtp_jax.runtime.files import write_atomically

DEFAULT_DRAFTS = {"cpu": 2, "other": 3}  # the most drafts a round considered on a CPU; the drafts elsewhere
MARGIN = 0.05  # drafting must beat plain decoding by this fraction (the timings' spread between runs)
PRIOR_RATE = 0.35  # the acceptance a depth is taken to have before it is measured (the shipped head's first depth
PRIOR_WEIGHT = 32  # on chat prompts), worth this many judged drafts: a few lucky rounds on one prompt do not decide
TIMED_TOKENS = 64  # tokens each row generates in a timed decode
TIMED_SWEEPS = 3  # timed decodes of each k, taken in turn (`timed_decodes`)
COSTS_FILE = "round_costs.json"


@dataclasses.dataclass(frozen=True)
class Drafting:
    """num_draft, adaptive and round_costs for a DecodeConfig, and why (one line for the summary)."""

    num_draft: int
    adaptive: bool
    round_costs: tuple[float, ...] | None
    reason: str


def choose(model, prompt_ids, prompt_lens, invariant: bool = False, max_draft: int | None = None,
           adaptive: bool = False, tree: tuple[int, int] = (0, 4)) -> Drafting:  # fmt: skip
    """The default drafting for `model` decoding a batch like `prompt_ids` [B, W] (lens [B]) here. `max_draft`:
    the most drafts a round, where the user named it; `adaptive`: the user asked for adaptive drafting, among
    chains and, with `tree` = (N, W) a node budget and width, that draft tree's rounds."""
    if not model.config.has_mtp:
        return Drafting(0, False, None, "plain decoding: the model has no MTP head")
    platform = jax.default_backend()
    if platform != "cpu" and model.config.moe is None:
        k = max_draft or DEFAULT_DRAFTS["other"]
        kind = "adaptive drafting, up to" if adaptive else "drafting"
        return Drafting(k, adaptive, None, f"{kind} {k} a round: on {platform} a verify pass costs about a plain step")
    k = max_draft or DEFAULT_DRAFTS["cpu" if platform == "cpu" else "other"]
    here = "this CPU" if platform == "cpu" else f"this {platform.upper()} (a mixture of experts: a round's cost timed)"
    if adaptive:
        costs, when = measured(model, prompt_ids, prompt_lens, k, invariant, "adaptive", tree)
        shown = ", ".join(f"{c:.2f}" for c in costs["costs"][: k + 1])
        tree_cost = f", a tree of {tree[0]} nodes {costs['costs'][-1]:.2f}" if tree[0] else ""
        return Drafting(k, True, tuple(costs["costs"]), f"adaptive drafting, up to {k} a round: rounds with "
                        f"0..{k} drafts cost {shown}{tree_cost} plain steps on {here} ({when})")  # fmt: skip
    found, when = measured(model, prompt_ids, prompt_lens, k, invariant, "fixed")
    costs, rates = np.asarray(found["costs"]), acceptance(found["judged"], found["accepted"])
    value = np.asarray(expected_tokens(rates)) / costs  # tokens per plain step's time, k = 0..max
    best = int(np.argmax(value))
    shown = ", ".join(f"{c:.2f}" for c in costs)
    judged = ", ".join(f"{a}/{j}" for a, j in zip(found["accepted"], found["judged"], strict=True))
    facts = f"rounds of 0..{k} drafts cost {shown} plain steps, the head's drafts accepted {judged} ({when})"
    if best == 0 or value[best] < 1.0 + MARGIN:
        return Drafting(0, False, None, f"plain decoding: on {here} no draft count pays ({facts})")
    return Drafting(best, False, None, f"{best} draft(s) a round, {value[best]:.2f}x plain's tokens per unit of "
                    f"time expected on {here} ({facts})")  # fmt: skip


def acceptance(judged, accepted) -> np.ndarray:
    """Conditional acceptance per depth [k], float32: the measured counts with PRIOR_WEIGHT drafts at PRIOR_RATE."""
    judged, accepted = np.asarray(judged, np.float32), np.asarray(accepted, np.float32)
    return (accepted + PRIOR_RATE * PRIOR_WEIGHT) / (judged + PRIOR_WEIGHT)


def apply(cfg: DecodeConfig, drafting: Drafting) -> DecodeConfig:
    return dataclasses.replace(
        cfg, num_draft=drafting.num_draft, adaptive=drafting.adaptive, round_costs=drafting.round_costs
    )


def measured(model, prompt_ids, prompt_lens, max_draft: int, invariant: bool, kind: str,
             tree: tuple[int, int] = (0, 4)) -> tuple[dict, str]:  # fmt: skip
    """({"costs": [...], "acceptance": [...]} for this model here, and when it was measured): rounds of a fixed-k
    loop ("fixed") or an adaptive loop's round costs ("adaptive"; with `tree` = (N, W) a node budget, its tree
    round's last), timed once, then read from the cache file."""
    batch = int(np.shape(prompt_ids)[0])
    key = _costs_key(model, batch, max_draft, invariant, kind + (f"/tree {tree[0]}x{tree[1]}" if tree[0] else ""))
    path = costs_path()
    known = _read(path)
    if key in known:
        return known[key], "measured here earlier"
    print(f"mtp_jax: timing this device's decoding once (batch {batch}, 0..{max_draft} drafts a round), to choose the "
          "default drafting", file=sys.stderr)  # fmt: skip
    if kind == "adaptive":
        timer = RoundTimer(model, prompt_ids, prompt_lens, TIMED_TOKENS, invariant=invariant, iterations=16,
                           repeats=TIMED_SWEEPS)  # fmt: skip
        found = {"costs": list(timer.adaptive_costs(max_draft, *tree))}
        if not drafting_can_pay(tuple(found["costs"]), max_draft):
            found["costs"] = [1.0] * len(found["costs"])  # no draft can pay: the loop compiles to plain decoding
    else:
        costs, judged, accepted = timed_decodes(model, prompt_ids, prompt_lens, max_draft, invariant)
        found = {"costs": list(costs), "judged": list(judged), "accepted": list(accepted)}
    known = _read(path)  # another process may have written meanwhile
    known[key] = found
    write_atomically(str(path), json.dumps(known, indent=1, sort_keys=True))
    return found, "measured now on these prompts, kept for later runs"


def timed_decodes(model, prompt_ids, prompt_lens, max_draft: int, invariant: bool) -> tuple:
    """(a round's time over a plain step's for k = 0..max_draft drafts a round, and per depth the drafts judged and
    accepted in the max_draft decode): greedy decodes of the prompts (ids [B, W], lens [B]), TIMED_TOKENS tokens a
    row with EOS ignored. A round's time is its decode's over its loop iterations: the prefill (with the MTP
    layer's, for k >= 1) and the loop's bookkeeping are in it, as they are in the decode it chooses for.

    Each sweep times every k's compiled `generate` once, in turn, and gives each k's ratio to that sweep's plain
    decode; the median of TIMED_SWEEPS sweeps is kept. A shared host's speed drifts over seconds, so ratios taken
    within one sweep hold up better than each k's fastest run. A round with more drafts does all the work of one
    with fewer, so noise that says otherwise is evened out: each cost at least the one before, and at least 1."""
    ids, lens, key = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_lens, jnp.int32), jax.random.key(0)
    configs = [DecodeConfig(num_draft=k, max_new_tokens=TIMED_TOKENS, stop_on_eos=False, invariant=invariant)
               for k in range(max_draft + 1)]  # fmt: skip
    programs = [compile_generate(model, ids, lens, key, cfg, keep=False) for cfg in configs]
    walls, outputs = np.zeros((TIMED_SWEEPS, len(configs))), [None] * len(configs)  # [sweeps, k + 1] seconds
    for sweep in range(TIMED_SWEEPS):
        for k, (program, cfg) in enumerate(zip(programs, configs, strict=True)):
            start = time.perf_counter()
            outputs[k] = jax.block_until_ready(program(model, ids, lens, key, cfg))
            walls[sweep, k] = time.perf_counter() - start
    stats = jax.device_get([out.stats for out in outputs])
    rounds = np.asarray([int(s.rounds) for s in stats], np.float64)  # [k + 1] loop iterations (greedy: every run's)
    per_round = walls / rounds  # [sweeps, k + 1]
    costs = np.median(per_round / per_round[:, :1], axis=0)
    costs = np.maximum.accumulate(np.maximum(costs, 1.0))
    judged, accepted = (tuple(int(n) for n in counts) for counts in (stats[-1].reached, stats[-1].accepted_at))
    return tuple(float(c) for c in costs), judged, accepted


def costs_path() -> Path:
    return Path(cache_dir()) / COSTS_FILE


def _read(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _costs_key(model, batch_size: int, max_draft: int, invariant: bool, kind: str) -> str:
    """Everything the measurement depends on but the prompts: the model's config and parameter shapes and dtypes,
    a sample of their values (`values_sample`), the kernel's library and ISA level, JAX's version, the CPU's cores, the
    batch, the drafts, the numerics."""
    leaves = [(x.shape, str(x.dtype)) for x in jax.tree.leaves(nnx.state(model))]
    parts = [
        repr(model.config),
        repr(leaves),
        values_sample(model),
        cpu_rows.level(),
        str(cpu_rows.library_name()),
        jax.devices()[0].device_kind,
        " ".join(kernel_build.flags()),
        jax.__version__,
        str(os.cpu_count()),
        f"{batch_size}/{max_draft}/{invariant}/{kind}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


VALUES_SAMPLE = 4096  # values read from each of the model's arrays for the costs' key


def values_sample(model) -> str:
    """A digest of the first VALUES_SAMPLE values of every array of the model: what tells two models of one shape
    apart (a retrained head drafts otherwise, a finetuned trunk answers otherwise), without moving a large model
    (DeepSeek-V3's gigabytes) to the host."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(nnx.state(model)):
        digest.update(np.asarray(jnp.ravel(leaf)[:VALUES_SAMPLE]).tobytes())
    return digest.hexdigest()
