"""python -m mtp_jax.matmul_bench: its table's rows, and each storage's product equal to the product over the weight
dequantized first (computed apart, in float32)."""

from __future__ import annotations

import pytest

from mtp_jax.cli import matmul_bench


@pytest.mark.slow
def test_every_storage_and_kernel_computes_the_dequantized_product(capsys):
    argv = ["--shapes", "256x384", "--rows", "1", "4", "--calls", "1", "--kernels", "xla", "tiles"]
    assert matmul_bench.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "rows" not in line]
    assert len(lines) == 2 * 3 * 2
    cells = [[cell.strip() for cell in line.split("|")] for line in lines]
    assert [(c[3], c[4]) for c in cells[:6]] == [(f, k) for f in ("bfloat16", "fp8", "int8") for k in ("xla", "tiles")]
    errors = [float(c[7]) for c in cells]
    assert all(error < 1e-2 for error in errors), errors  # bfloat16 results


@pytest.mark.parametrize("bad", ["100x128", "128", "axb"])
def test_a_bad_shape_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        matmul_bench.main(["--shapes", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "weight shape" in err or "multiples of 128" in err
