"""python -m mtp_jax.product_invariance: whether this device's products give a row the same bits in a pass of any
width, the question under batch-invariant decoding.

    python -m mtp_jax.product_invariance [--shapes 576x1536 576x49152t] [--widths 1 2 8 16 256]
                                         [--kernels xla fixed_tiles] [--dtype bfloat16]

For each weight shape and kernel, a pass over the widest width's rows is the reference; a pass over its first R rows
is compared with it, row by row, bit for bit, for each width R. Printed as JSON: per shape and kernel, for each R,
how many of the R rows came out with other bits. "xla": XLA's own product with float32 results (what
`dispatch.project` asks for in the default mode); "fixed_tiles": the kernel batch-invariant decoding uses on a GPU
(kernels/fixed_tiles.py; elsewhere it runs in Pallas' interpreter, slowly). A shape is INPUTSxOUTPUTS; a trailing "t"
stores the weight as [OUTPUTS, INPUTS] (a tied lm_head read as the embedding). The defaults are the default model's
projections and its tied lm_head.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cli.arguments import positive_int
from mtp_jax.decode.stats import describe_device
from mtp_jax.kernels import fixed_tiles
from mtp_jax.runtime.errors import OneLineParser, UserError, run_cli

KERNELS = ("xla", "fixed_tiles")
DEFAULT_SHAPES = ("576x576", "576x1536", "1536x576", "576x49152t")
DEFAULT_WIDTHS = (1, 2, 3, 8, 16, 24, 32, 40, 128, 256)


def weight_shape(text: str) -> tuple[int, int, bool]:
    """Parse "576x1536" as (576, 1536, False) and "576x49152t" as (576, 49152, True): inputs, outputs, stored
    transposed."""
    transposed = text.endswith("t")
    parts = text.removesuffix("t").lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a weight shape is INPUTSxOUTPUTS[t], e.g. 576x1536; got {text!r}")
    return int(parts[0]), int(parts[1]), transposed


def product(kernel: str, transposed: bool):
    """The jitted product x [R, K] by the weight -> float32 [R, N] of `kernel`."""
    equation = "MK,NK->MN" if transposed else "MK,KN->MN"
    if kernel == "fixed_tiles":
        return jax.jit(lambda x, w: fixed_tiles.einsum(equation, x, w))
    return jax.jit(lambda x, w: jnp.einsum(equation, x, w, preferred_element_type=jnp.float32))


def rows_moved(fn, x: jax.Array, weight: jax.Array, widths) -> dict[int, int]:
    """For each width R: how many of x's first R rows come out of a pass of R rows with other bits than out of the
    pass of every row of x."""
    full = np.asarray(fn(x, weight))
    return {r: int(np.any(np.asarray(fn(x[:r], weight)) != full[:r], axis=1).sum()) for r in widths}


def check(shapes, widths, kernels, dtype) -> dict:
    """{"K x N": {kernel: {width: rows moved}}} for random normal inputs and weights."""
    rng = np.random.default_rng(0)
    report = {}
    for k, n, transposed in shapes:
        weight = jnp.asarray(rng.normal(size=(n, k) if transposed else (k, n)) / np.sqrt(k), dtype)
        x = jnp.asarray(rng.normal(size=(max(widths), k)), dtype)  # [R, K]
        name = f"{k}x{n}{'t' if transposed else ''}"
        report[name] = {kernel: rows_moved(product(kernel, transposed), x, weight, widths) for kernel in kernels}
    return report


def parse_args(argv=None):
    parser = OneLineParser(prog="python -m mtp_jax.product_invariance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=weight_shape, nargs="+", default=[weight_shape(s) for s in DEFAULT_SHAPES],
                        help=f"weights as INPUTSxOUTPUTS[t] (default: {' '.join(DEFAULT_SHAPES)})")  # fmt: skip
    parser.add_argument("--widths", type=positive_int, nargs="+", default=list(DEFAULT_WIDTHS),
                        help=f"rows per pass (default: {' '.join(map(str, DEFAULT_WIDTHS))})")  # fmt: skip
    parser.add_argument("--kernels", choices=KERNELS, nargs="+", default=list(KERNELS))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    return parser.parse_args(argv)


def run(args) -> int:
    if len(set(args.kernels)) != len(args.kernels):
        raise UserError("--kernels names a kernel twice")
    report = check(args.shapes, sorted(set(args.widths)), args.kernels, jnp.dtype(args.dtype))
    json.dump({"device": describe_device(), "jax": jax.__version__, "dtype": args.dtype, "rows_moved": report},
              sys.stdout, indent=1)  # fmt: skip
    print()
    return 0


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))
