"""python -m mtp_jax.matmul_bench: its table's rows, and each storage's product equal to the product over the weight
dequantized first (computed apart, in float32)."""

from __future__ import annotations

import pytest

from mtp_jax import matmul_bench


def test_every_storage_computes_the_dequantized_product(capsys):
    assert matmul_bench.main(["--shapes", "256x384", "--rows", "1", "4", "--calls", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "rows" not in line]
    assert len(lines) == 2 * 3
    forms = [line.split("|")[3].strip() for line in lines]
    assert forms == ["bfloat16", "fp8", "int8"] * 2
    errors = [float(line.split("|")[6]) for line in lines]
    assert all(error < 1e-4 for error in errors), errors


@pytest.mark.parametrize("bad", ["100x128", "128", "axb"])
def test_a_bad_shape_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        matmul_bench.main(["--shapes", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "weight shape" in err or "multiples of 128" in err
