"""`python -m mtp_jax.bench.rl_plot RUN.jsonl ... --out FIGURE.png`: the runs `python -m mtp_jax.bench.rl_rollouts`
wrote (one JSON line an RL step, one file a mode), plotted per RL step: the first drafts' acceptance on the current
policy's answers, both heads' expected acceptance scored on the same answers (the drafting head and the shipped one),
rollout tokens/s, the refresh's share of the step's wall clock, and the mean reward. Each run's first step holds the
set-up and the first compiles, so the refresh's share starts at the second."""

from __future__ import annotations

import argparse
import json
import sys

from matplotlib.figure import Figure

PANELS = (  # (title, the quantities it plots: a line for each and each run)
    ("first-draft acceptance on the policy's answers", ("first_draft_acceptance",)),
    ("expected first-draft acceptance (teacher-forced, T = 1)",
     ("head_expected_acceptance", "shipped_head_expected_acceptance")),
    ("rollout tokens/s", ("tokens_per_second",)),
    ("refresh / RL step wall clock", ("refresh_share",)),
    ("mean reward", ("mean_reward",)),
)  # fmt: skip
LINE_NAMES = {"head_expected_acceptance": "drafting head", "shipped_head_expected_acceptance": "shipped head"}


def value(row: dict, name: str) -> float | None:
    """A step's quantity of PANELS; None where it has none: no acceptance without drafts, no refresh share without a
    refresh, in the first step (its set-up) or where the step's seconds were not recorded."""
    if name != "refresh_share":
        return row.get(name)
    step = row.get("step_seconds")
    return row["refresh_seconds"] / step if step and row["step"] > 0 and row["refresh_seconds"] > 0 else None


def plot(runs: dict[str, list[dict]]) -> Figure:
    """A figure of one panel per PANELS entry, a line per run and quantity (the run's mode, and the quantity's
    LINE_NAMES entry where a panel has several); steps without a quantity (`value`) are left out of its line. A
    matplotlib `Figure` of its own (no pyplot state): `savefig` it, or display it."""
    fig = Figure(figsize=(5 * len(PANELS), 4))
    axes = fig.subplots(1, len(PANELS))
    for mode, rows in runs.items():
        for ax, (_, names) in zip(axes, PANELS, strict=True):
            for name in names:
                points = [(row["step"], value(row, name)) for row in rows]
                points = [(step, y) for step, y in points if y is not None]
                label = mode if len(names) == 1 else f"{mode}: {LINE_NAMES[name]}"
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=label)
    for ax, (title, _) in zip(axes, PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel("RL step")
        if ax.has_data():
            ax.legend()
    fig.tight_layout()
    return fig


def read_run(path: str) -> tuple[str, list[dict]]:
    """(the run's mode, its steps' records) from a JSON-lines file of `rl_rollouts` (its end-of-run comparison, a
    record of its own, left out); ValueError naming what is wrong."""
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON lines ({e.msg}, line {e.lineno})") from None
    rows = [row for row in rows if not (isinstance(row, dict) and "end_of_run" in row)]
    needed = {"mode", "step", "refresh_seconds", "tokens_per_second", "mean_reward"}
    if not rows or any(not isinstance(row, dict) or needed - row.keys() for row in rows):
        raise ValueError(f"{path}: expected python -m mtp_jax.bench.rl_rollouts records ({', '.join(sorted(needed))})")
    modes = {row["mode"] for row in rows}
    if len(modes) != 1:
        raise ValueError(f"{path}: one run a file, found modes {sorted(modes)}")
    return modes.pop(), rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.bench.rl_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="JSON-lines files of python -m mtp_jax.bench.rl_rollouts")
    parser.add_argument("--out", required=True, help="the figure (.png, .svg or .pdf)")
    args = parser.parse_args(argv)
    runs = {}
    try:
        for path in args.runs:
            mode, rows = read_run(path)
            if mode in runs:
                raise ValueError(f"{path}: a second run of mode {mode!r}")
            runs[mode] = rows
        plot(runs).savefig(args.out, dpi=110)
    except (ValueError, OSError) as e:  # OSError: the figure's path
        print(f"rl_plot: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {', '.join(f'{mode} ({len(rows)} steps)' for mode, rows in runs.items())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
