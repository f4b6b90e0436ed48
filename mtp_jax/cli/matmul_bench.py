"""python -m mtp_jax.matmul_bench: one projection's time with its weight stored as bfloat16, fp8 (128x128 block
scales) or int8 (per-channel scales), by each kernel the models use for it.

Decode steps are reads of weights, so a projection of a few rows should take about its stored bytes over the memory
bandwidth: fp8 and int8 half of bfloat16's time. This measures whether a device's compiled matmul gets there, and
checks each product against the product over the weight dequantized first (the `rel err` column). Kernels: "xla",
XLA's own product (a quantized weight's values in the dot, the scales on its float32 partial products:
`quant.quantized_einsum`); "tiles", the fixed-tile kernel (kernels/fixed_tiles.py: Triton on a GPU, where decoding
reads quantized weights with it; Pallas' interpreter elsewhere, slow).
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cli.arguments import positive_int
from mtp_jax.decode.stats import describe_device
from mtp_jax.kernels import fixed_tiles
from mtp_jax.quant import blocked_product, fp8, int8, quantized_array
from mtp_jax.runtime.errors import OneLineParser, UserError, run_cli

FORMS = ("bfloat16", "fp8", "int8")
KERNELS = ("xla", "tiles")
EQUATION = "...D,DF->...F"


def weight_shape(text: str) -> tuple[int, int]:
    """Parse "4096x11008" as (4096, 11008): inputs x outputs, each a multiple of the fp8 block (128)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a weight shape is INPUTSxOUTPUTS, e.g. 4096x11008; got {text!r}")
    k, n = int(parts[0]), int(parts[1])
    if k % 128 or n % 128:
        raise argparse.ArgumentTypeError(f"{text}: both sizes must be multiples of 128 (the fp8 scale block)")
    return k, n


def stored(weight: jax.Array, form: str) -> jax.Array | quantized_array.QuantizedArray:
    """`weight` ([K, N], float32) in storage `form`."""
    if form == "bfloat16":
        return weight.astype(jnp.bfloat16)
    return fp8.quantize_fp8(weight, (0,)) if form == "fp8" else int8.quantize_int8(weight, (0,))


def stored_bytes(weight) -> int:
    return weight.nbytes if isinstance(weight, quantized_array.QuantizedArray) else weight.size * weight.dtype.itemsize


def seconds_per_call(fn, *args, calls: int, trials: int = 5) -> float:
    """Device time of one `fn(*args)`: `calls` calls enqueued back to back and waited for once (so the host's
    dispatch overlaps the device's work), divided by `calls`; the median of `trials`, after one untimed call."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def relative_error(matmul, weight, x: jax.Array) -> float:
    """|matmul(x, weight) - x @ dequantized weight| / |x @ dequantized weight|, in float32."""
    dense = quantized_array.dense(weight).astype(jnp.float32)  # [K, N]
    reference = jnp.einsum(EQUATION, x.astype(jnp.float32), dense, precision="highest")
    got = matmul(x, weight).astype(jnp.float32)
    return float(jnp.linalg.norm(got - reference) / jnp.linalg.norm(reference))


def product(x: jax.Array, weight, kernel: str) -> jax.Array:
    """x [M, K] times the weight [K, N] by `kernel` -> [M, N] in x's dtype (float32 sums)."""
    if kernel == "tiles":
        return fixed_tiles.einsum(EQUATION, x, weight).astype(x.dtype)
    if isinstance(weight, quantized_array.QuantizedArray):
        return blocked_product.quantized_einsum(EQUATION, x, weight).astype(x.dtype)
    return jnp.einsum(EQUATION, x, weight, preferred_element_type=jnp.float32).astype(x.dtype)


def measure(shapes, rows, forms, calls: int, kernels=("xla",)) -> list[dict]:
    """One row per (weight shape, number of rows, storage, kernel)."""
    matmuls = {kernel: jax.jit(lambda x, w, kernel=kernel: product(x, w, kernel)) for kernel in kernels}
    results = []
    for k, n in shapes:
        weight = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02  # [K, N]
        by_form = {form: stored(weight, form) for form in forms}
        for m in rows:
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)  # [M, K]
            for (form, w), (kernel, matmul) in itertools.product(by_form.items(), matmuls.items()):
                seconds = seconds_per_call(matmul, x, w, calls=calls)
                results.append({"rows": m, "inputs": k, "outputs": n, "form": form, "kernel": kernel,
                                "seconds": seconds, "stored_bytes": stored_bytes(w),
                                "relative_error": relative_error(matmul, w, x)})  # fmt: skip
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| rows | weight K x N | form | kernel | us | GB/s of stored weight | rel err |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        rate = r["stored_bytes"] / r["seconds"] / 1e9
        lines.append(f"| {r['rows']} | {r['inputs']} x {r['outputs']} | {r['form']} | {r['kernel']} | "
                     f"{r['seconds'] * 1e6:.1f} | {rate:.0f} | {r['relative_error']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv=None):
    parser = OneLineParser(prog="python -m mtp_jax.matmul_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=weight_shape, nargs="+", default=[(4096, 11008), (7168, 18432)],
                        help="weights as INPUTSxOUTPUTS (default: 4096x11008 7168x18432)")  # fmt: skip
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 64], help="default: 1 8 64")
    parser.add_argument("--forms", choices=FORMS, nargs="+", default=list(FORMS))
    parser.add_argument("--kernels", choices=KERNELS, nargs="+", default=None,
                        help="default: xla and tiles on a GPU, else xla (tiles run interpreted there)")  # fmt: skip
    parser.add_argument("--calls", type=positive_int, default=50,
                        help="calls enqueued per timing, the median of 5 timings (default 50)")  # fmt: skip
    return parser.parse_args(argv)


def run(args) -> int:
    if len(set(args.forms)) != len(args.forms):
        raise UserError("--forms names a storage twice")
    kernels = args.kernels or (list(KERNELS) if jax.default_backend() == "gpu" else ["xla"])
    if len(set(kernels)) != len(kernels):
        raise UserError("--kernels names a kernel twice")
    results = measure(args.shapes, args.rows, args.forms, args.calls, kernels)
    print(f"device: {describe_device()}; jax {jax.__version__}; {args.calls} calls enqueued per timing, median of 5")
    print(markdown(results))
    return 0


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))
