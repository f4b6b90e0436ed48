"""python -m mtp_jax.product_invariance: its report finds XLA:CPU's one-row product (a row's bits moved) and none
in the fixed tiles; bad shapes are refused in one line."""

from __future__ import annotations

import json

import pytest

from mtp_jax.cli import product_invariance


@pytest.mark.slow
def test_reports_the_rows_whose_bits_moved(capsys):
    argv = ["--shapes", "576x200", "96x40t", "--widths", "1", "2", "5", "--kernels", "xla", "fixed_tiles"]
    assert product_invariance.main(argv) == 0
    report = json.loads(capsys.readouterr().out)["rows_moved"]
    assert set(report) == {"576x200", "96x40t"}
    for kernels in report.values():
        assert kernels["fixed_tiles"] == {"1": 0, "2": 0, "5": 0}
    assert report["576x200"]["xla"]["1"] == 1  # XLA:CPU runs a lone row through its matrix-vector kernel
    assert report["576x200"]["xla"]["5"] == 0


@pytest.mark.parametrize("bad", ["576", "axb", "0x5"])
def test_a_bad_shape_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        product_invariance.main(["--shapes", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
