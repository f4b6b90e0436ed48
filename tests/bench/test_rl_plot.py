"""`python -m mtp_jax.bench.rl_plot`: the RL bench's runs plotted per step (each panel's points are the records'
own values), and bad input refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtp_jax.bench import rl_plot


def records(mode: str, steps: int) -> list[dict]:
    """Records shaped as `rl_rollouts` writes them (plain runs have no acceptance and no refresh; both heads are
    scored in every mode)."""
    drafts = mode != "plain"
    return [{"mode": mode, "step": step, "mean_reward": 0.1 * step, "rollout_seconds": 10.0,
             "refresh_seconds": 2.0 * step if mode == "refresh" else 0.0, "tokens": 400,
             "tokens_per_second": 40.0 + step, "first_draft_acceptance": 0.4 + 0.01 * step if drafts else None,
             "tokens_per_round": 1.6 if drafts else 1.0, "step_seconds": 40.0,
             "head_expected_acceptance": 0.7 + 0.02 * step, "shipped_head_expected_acceptance": 0.7 - 0.02 * step,
             } for step in range(steps)]  # fmt: skip


def write(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_each_panel_plots_each_runs_own_values(tmp_path):
    runs = {mode: records(mode, 5) for mode in ("refresh", "frozen", "plain")}
    end = {"mode": "refresh", "end_of_run": {"speedup": 1.1}}  # the run's last line: not a step
    paths = [
        write(tmp_path / f"{mode}.jsonl", rows + ([end] if mode == "refresh" else [])) for mode, rows in runs.items()
    ]
    assert rl_plot.read_run(paths[0]) == ("refresh", runs["refresh"])
    assert rl_plot.main([*paths, "--out", str(tmp_path / "runs.png")]) == 0
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    axes = rl_plot.plot(runs).axes
    lines = {(ax.get_title(), line.get_label()): line.get_xydata() for ax in axes for line in ax.get_lines()}
    acceptance, scored, share = (rl_plot.PANELS[i][0] for i in (0, 1, 3))
    assert {label for title, label in lines if title == acceptance} == {"refresh", "frozen"}  # plain drafts nothing
    assert {label for title, label in lines if title == share} == {"refresh"}
    assert len([label for title, label in lines if title == scored]) == 6  # both heads, each run
    np.testing.assert_allclose(lines[acceptance, "frozen"], [[s, 0.4 + 0.01 * s] for s in range(5)])
    np.testing.assert_allclose(lines[scored, "refresh: shipped head"], [[s, 0.7 - 0.02 * s] for s in range(5)])
    np.testing.assert_allclose(lines[scored, "plain: drafting head"], [[s, 0.7 + 0.02 * s] for s in range(5)])
    np.testing.assert_allclose(lines[share, "refresh"], [[s, 2.0 * s / 40.0] for s in range(1, 5)])  # after set-up
    np.testing.assert_allclose(lines["rollout tokens/s", "plain"], [[s, 40.0 + s] for s in range(5)])


@pytest.mark.parametrize(
    "contents, message",
    [
        (None, "No such file"),
        ("not json\n", "not JSON lines"),
        ('{"step": 0}\n', "expected python -m mtp_jax.bench.rl_rollouts records"),
        ("mixed", "one run a file"),
    ],
)
def test_bad_runs_are_one_line(tmp_path, capsys, contents, message):
    path = tmp_path / "run.jsonl"
    if contents == "mixed":
        write(path, records("refresh", 2) + records("frozen", 2))
    elif contents is not None:
        path.write_text(contents)
    assert rl_plot.main([str(path), "--out", str(tmp_path / "runs.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not (tmp_path / "runs.png").exists()


def test_a_mode_given_twice_or_an_unwritable_figure_is_one_line(tmp_path, capsys):
    path = write(tmp_path / "a.jsonl", records("frozen", 2))
    assert rl_plot.main([path, path, "--out", str(tmp_path / "runs.png")]) == 2
    assert rl_plot.main([path, "--out", str(tmp_path / "missing" / "runs.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "a second run of mode 'frozen'" in err[0] and "missing" in err[1]
