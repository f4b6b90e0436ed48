"""Decode statistics on the host: sum per-batch counters, then the contract's summary fields."""

from __future__ import annotations

import jax
import numpy as np

from mtp_jax.decode.loop_state import DecodeStats


def add(total: dict | None, stats: DecodeStats) -> dict:
    """Running host-side sum of `DecodeStats` counters."""
    batch = {name: np.asarray(getattr(stats, name)).astype(np.int64) for name in DecodeStats.__dataclass_fields__}
    if total is None:
        return batch
    return {name: total[name] + batch[name] for name in total}


def summarize(
    counters: dict,
    *,
    num_draft: int,
    generated_tokens: int,
    tree: int = 0,
    wall: float,
    compile_seconds: float,
    compile_from_cache: bool = False,
) -> dict:
    """The stats JSON of `python -m mtp_jax.decode` (see the contract); `tree`: a draft tree's node budget (0: chains;
    num_draft is then its depth); `compile_from_cache`: every decode program was read from the persistent compilation
    cache (`compile_cache`)."""
    row_rounds = max(int(counters["row_rounds"]), 1)
    drafted = int(counters["drafted"])
    reached = counters["reached"]
    per_position = [float(a / r) if r else 0.0 for a, r in zip(counters["accepted_at"], reached, strict=True)]
    return {
        "num_draft": num_draft,
        "tree": tree,
        "rounds": int(counters["rounds"]),
        "generated_tokens": int(generated_tokens),
        "mean_accepted_length": float(counters["emitted"]) / row_rounds,
        "acceptance_rate": float(counters["accepted"]) / drafted if drafted else 0.0,
        "acceptance_per_position": per_position,  # by depth, for a tree
        "mean_accepted_depth": float(counters["accepted"]) / row_rounds,  # drafts accepted per verify round
        "rounds_by_num_draft": [int(n) for n in counters["rounds_with"]],  # loop rounds that drafted j = 0..k
        "rest_rounds": int(counters["rests"]),  # adaptive: rounds of the above with j = 0 that skipped the MTP layer
        "tree_rounds": int(counters["tree_rounds"]),  # rounds of the above with j = k that verified a draft tree
        "tokens_per_second": generated_tokens / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
        "compile_seconds": compile_seconds,
        "compile_from_cache": compile_from_cache,
        "device": describe_device(),
    }


def describe_device() -> str:
    device = jax.devices()[0]
    return f"{device.platform}:{getattr(device, 'device_kind', device.platform)} x{jax.device_count()}"


def summary_paragraph(stats: dict, num_prompts: int) -> str:
    per_position = ", ".join(f"{p:.2f}" for p in stats["acceptance_per_position"])
    text = (
        f"Generated {stats['generated_tokens']} tokens for {num_prompts} prompt(s) in {stats['wall_seconds']:.2f}s "
        f"({stats['tokens_per_second']:.1f} tokens/s; {setup(stats)} apart) "
        f"on {stats['device']} with {drafting(stats)}: "
        f"mean accepted length {stats['mean_accepted_length']:.2f} tokens per verify round"
    )
    if stats["num_draft"]:
        text += f", acceptance rate {stats['acceptance_rate']:.2f}, per position [{per_position}]"
    text += "."
    if stats.get("drafting"):
        text += f" Drafting chosen: {stats['drafting']}."
    return text


def drafting(stats: dict) -> str:
    """How rounds drafted: "3 draft(s) per round", or "a draft tree of 16 nodes, depth 3"."""
    if stats.get("tree"):
        return f"a draft tree of {stats['tree']} nodes, depth {stats['num_draft']}"
    return f"{stats['num_draft']} draft(s) per round"


def setup(stats: dict) -> str:
    """What came before decoding: "load 0.4s, compile 0.3s (from the cache)"."""
    load = f"load {stats['load_seconds']:.1f}s, " if "load_seconds" in stats else ""
    cached = " (from the cache)" if stats.get("compile_from_cache") else ""
    return f"{load}compile {stats['compile_seconds']:.1f}s{cached}"
