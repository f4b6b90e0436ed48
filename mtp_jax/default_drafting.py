"""The drafting a decode gets when it names none (`decode` without --num-draft, `generate_text` without a config):
drafting that pays on the device it runs on, and one line saying what was chosen and why.

- No MTP head: plain decoding.
- An accelerator: DEFAULT_DRAFTS["other"] drafts a round. A verify pass of a few rows there is a read of the
  weights, about one plain step (docs/benchmarks.md), so each accepted draft is a step saved.
- A CPU: adaptive drafting (mtp_jax.adaptive), up to DEFAULT_DRAFTS["cpu"] a round, from round costs measured on
  this machine. A CPU's verify pass costs more than a plain step in proportion to its rows (the row kernel's sums
  are compute, not only reads), and by how much depends on the CPU's ISA level, its cores and the model: so the
  rounds are timed (`round_timing.RoundTimer.adaptive_costs`, the bench's own timing) once per model, kernel build,
  batch size and settings, and kept in `~/.cache/mtp_jax/round_costs.json`. Where no draft can pay, adaptive
  decoding compiles to plain decoding; where the head's acceptance on the text does not pay, the loop rests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from mtp_jax.adaptive import drafting_can_pay
from mtp_jax.config import DecodeConfig
from mtp_jax.files import write_atomically
from mtp_jax.models import cpu_rows, kernel_build
from mtp_jax.round_timing import RoundTimer

DEFAULT_DRAFTS = {"cpu": 2, "other": 3}  # the most drafts a round: adaptive on a CPU, fixed elsewhere
TIMED_PROMPT = 32  # tokens of the prompt rows the rounds are timed after
TIMED_TOKENS = 64  # the budget whose cache the timed rounds use
COSTS_FILE = "round_costs.json"


@dataclasses.dataclass(frozen=True)
class Drafting:
    """num_draft, adaptive and round_costs for a DecodeConfig, and why (one line for the summary)."""

    num_draft: int
    adaptive: bool
    round_costs: tuple[float, ...] | None
    reason: str


def choose(model, batch_size: int, invariant: bool = False, max_draft: int | None = None,
           adaptive: bool = False) -> Drafting:  # fmt: skip
    """The default drafting for `model` decoding `batch_size` rows here. `max_draft`: the most drafts a round, where
    the user named it; `adaptive`: the user asked for adaptive drafting (on an accelerator, with estimated costs)."""
    if not model.config.has_mtp:
        return Drafting(0, False, None, "plain decoding: the model has no MTP head")
    platform = jax.default_backend()
    if platform != "cpu":
        k = max_draft or DEFAULT_DRAFTS["other"]
        kind = "adaptive drafting, up to" if adaptive else "drafting"
        return Drafting(k, adaptive, None, f"{kind} {k} a round: on {platform} a verify pass costs about a plain step")
    k = max_draft or DEFAULT_DRAFTS["cpu"]
    costs, measured_now = cpu_round_costs(model, batch_size, k, invariant)
    shown = ", ".join(f"{c:.2f}" for c in costs)
    where = "measured now, kept for later runs" if measured_now else "measured on this CPU earlier"
    if not drafting_can_pay(costs):
        return Drafting(0, False, None, f"plain decoding: rounds with 0..{k} drafts cost {shown} plain steps on this "
                        f"CPU ({where}), so no draft can pay")  # fmt: skip
    return Drafting(k, True, costs, f"adaptive drafting, up to {k} a round: rounds with 0..{k} drafts cost {shown} "
                    f"plain steps on this CPU ({where})")  # fmt: skip


def apply(cfg: DecodeConfig, drafting: Drafting) -> DecodeConfig:
    return dataclasses.replace(
        cfg, num_draft=drafting.num_draft, adaptive=drafting.adaptive, round_costs=drafting.round_costs
    )


def cpu_round_costs(model, batch_size: int, max_draft: int, invariant: bool) -> tuple[tuple[float, ...], bool]:
    """(round costs for j = 0..max_draft drafts in plain steps, whether they were measured now): timed once, then
    read from the cache file."""
    key = _costs_key(model, batch_size, max_draft, invariant)
    path = costs_path()
    known = _read(path)
    if key in known:
        return tuple(known[key]), False
    print(f"mtp_jax: timing this CPU's decode rounds once (batch {batch_size}, 0..{max_draft} drafts), to choose the "
          "default drafting", file=sys.stderr)  # fmt: skip
    ids = np.tile(np.arange(1, TIMED_PROMPT + 1, dtype=np.int32) % model.config.vocab_size, (batch_size, 1))
    lens = np.full((batch_size,), TIMED_PROMPT, np.int32)
    timer = RoundTimer(model, ids, lens, TIMED_TOKENS, invariant=invariant, iterations=8, repeats=3)
    costs = timer.adaptive_costs(max_draft)
    known = _read(path)  # another process may have written meanwhile
    known[key] = list(costs)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(str(path), json.dumps(known, indent=1, sort_keys=True))
    return costs, True


def costs_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mtp_jax" / COSTS_FILE


def _read(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _costs_key(model, batch_size: int, max_draft: int, invariant: bool) -> str:
    """Everything the costs depend on: the model's config and parameter shapes and dtypes, the kernel's build and
    ISA level, JAX's version, the CPU's cores, the batch, the drafts and the numerics."""
    leaves = [(x.shape, str(x.dtype)) for x in jax.tree.leaves(nnx.state(model))]
    parts = [
        repr(model.config),
        repr(leaves),
        cpu_rows.level(),
        " ".join(kernel_build.flags()),
        jax.__version__,
        str(os.cpu_count()),
        f"{batch_size}/{max_draft}/{invariant}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
