"""Where the CPU row kernel is faster than XLA's own product on this machine, measured.

The row kernel serves a decode step's few rows; XLA:CPU's product of the same operands can be the faster one (a
wide pass of rows through its GEMM, a CPU whose level the kernel has no fast path for). Outside batch-invariant
decoding (where the kernel is needed for its bits) a product takes the kernel only where it won: each weight form
(float32, bfloat16, int8 per channel, int8 in blocks as GGUF's Q8_0, 4-bit blocks as Q4_1 with float or
int8-rounded rows) is timed at a few row counts both ways, on a weight of a decode step's size, [K, N] as a
projection reads it and [N, K] as a tied lm_head reads the embedding (the kernel's other loop), once per kernel
library (its name covers the sources, compiler, flags, jaxlib and CPU), and the table is kept beside the library in
the user's cache. `python -m mtp_jax.bench` prints the table (measured tables:
docs/benchmarks.md#avx2-host-amd-epyc-x86-64-v3, which links the log's).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.ops import matmul_layout
from mtp_jax.quant.int4 import quantize_int4
from mtp_jax.quant.int8 import quantize_int8, quantize_int8_blocks
from mtp_jax.quant.quantized_array import QuantizedArray
from mtp_jax.runtime.files import write_atomically

ROWS = (1, 2, 4, 8, 16, 64)  # row counts timed; a pass takes the verdict of the nearest one at or above it
SHAPE = (576, 1536)  # K, N of the timed weight: a small model's MLP projection (a decode step's typical read)
EQUATION = "MK,KN->MN"
TRANSPOSED = "MK,NK->MN"  # a tied lm_head's product: the embedding's rows [V, D] read as the weight
CALLS = 10  # calls per timing
SWEEPS = 3  # timings of each, interleaved; the fastest is kept
FORMS = ("float32", "bfloat16", "int8", "q8_0", "q4_1", "q4_1_int8_rows")
TRANSPOSED_FORMS = ("float32", "bfloat16", "int8", "q8_0")  # the forms the kernel reads as [N, K] too
TRANSPOSED_KEY = " [N, K]"  # the table's key for a form read transposed: "q8_0 [N, K]"
TABLE_VERSION = 2  # in the kept table's name: a table of other keys is measured again
DISABLE_ENV = "MTP_JAX_KERNEL_CHOICE"  # "0": take the kernel wherever it can run (no measurement)
_LOCK = threading.Lock()


def form_of(weight) -> str | None:
    """The measured form of a weight (or of a StackedWeight's layer): None for a form not measured."""
    weight = weight.layer_shapes() if hasattr(weight, "layer_shapes") else weight
    if not isinstance(weight, QuantizedArray):
        name = jnp.dtype(weight.dtype).name
        return name if name in ("float32", "bfloat16") else None
    if weight.packed:
        return "q4_1_int8_rows" if weight.int8_activations else "q4_1"
    if weight.values.dtype == jnp.int8:
        return "int8" if weight.scales.dtype == jnp.float32 and weight.mins is None else "q8_0"
    return None


def timed_weight(form: str, rng: np.random.Generator, transposed: bool = False):
    """A [K, N] weight of `form` (SHAPE) with random values; [N, K] when transposed."""
    w = jnp.asarray(rng.normal(size=SHAPE[::-1] if transposed else SHAPE) / 16, jnp.float32)
    contracting = (1,) if transposed else (0,)
    if form in ("float32", "bfloat16"):
        return w.astype(form)
    if form == "int8":
        return quantize_int8(w, contracting)
    if form == "q8_0":
        return quantize_int8_blocks(w, contracting)
    return dataclasses.replace(quantize_int4(w, contracting), int8_activations=form == "q4_1_int8_rows")


def losing_products(table: dict) -> tuple[str, ...]:
    """The "form@rows" keys of `table` where XLA's form ran faster than the kernel, sorted (an execution plan's
    `kernel_loses`: config/execution_plan.py)."""
    losing = [
        (form, int(rows))
        for form, verdicts in table.items()
        for rows, verdict in verdicts.items()
        if verdict["kernel_us"] > verdict["xla_us"]
    ]
    return tuple(f"{form}@{rows}" for form, rows in sorted(losing))


def product_key(equation: str, x: jax.Array, weight) -> str | None:
    """This product's key in the table: its weight's form (read transposed or not) at the nearest measured row
    count at or above its rows; None for a form not measured (it takes the kernel)."""
    form = form_of(weight)
    if form is None:
        return None
    layer_shape = (weight.layer_shapes() if hasattr(weight, "layer_shapes") else weight).shape
    lay = matmul_layout.layout(equation, x.shape, layer_shape)
    timed = next((r for r in ROWS if r >= lay.gmkn[1]), ROWS[-1])
    return f"{form}{TRANSPOSED_KEY if lay.transposed else ''}@{timed}"


def table_for(library: Path, folder: Path, kernel: Callable, xla: Callable) -> dict:
    """{form: {rows: {"kernel_us", "xla_us"}}} for the kernel library at `library`: read from `folder`, else
    measured now (once per library) and kept there. `kernel` and `xla`: (equation, x, weight) -> float32 product."""
    with _LOCK:
        return _table(library, folder, kernel, xla)


@functools.cache
def _table(library: Path, folder: Path, kernel: Callable, xla: Callable) -> dict:
    path = folder / f"{library.name}.choice{TABLE_VERSION}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    print("mtp_jax: timing the CPU row kernel against XLA's products once for this build", file=sys.stderr)
    measured = outside_any_trace(functools.partial(measure, kernel, xla))
    write_atomically(str(path), json.dumps(measured, indent=1))
    return measured


def outside_any_trace(run: Callable[[], dict]) -> dict:
    """run() in a thread of its own: the table is asked for while a program is traced, and JAX stages every call
    made under a trace into that program instead of running it; a new thread starts outside any trace."""
    result = []
    worker = threading.Thread(target=lambda: result.append(run()), name="mtp_jax-kernel-choice")
    worker.start()
    worker.join()
    if not result:
        raise RuntimeError("timing the CPU row kernel failed (see the thread's error above)")
    return result[0]


def measure(kernel: Callable, xla: Callable) -> dict:
    """Each form at each of ROWS, through the kernel and through XLA, in microseconds per product, [K, N] and (for
    TRANSPOSED_FORMS) [N, K]: the two timed in turn, SWEEPS times over, each keeping its fastest (a busy spell of
    the machine slows both, and only adds)."""
    rng = np.random.default_rng(0)
    result = {}
    timed = [(form, False) for form in FORMS] + [(form, True) for form in TRANSPOSED_FORMS]
    for form, transposed in timed:
        weight = timed_weight(form, rng, transposed)
        key = form + (TRANSPOSED_KEY if transposed else "")
        result[key] = {}
        for rows in ROWS:
            x = jnp.asarray(rng.normal(size=(rows, SHAPE[0])), jnp.float32)
            equation = TRANSPOSED if transposed else EQUATION
            calls = [jax.jit(functools.partial(f, equation)) for f in (kernel, xla)]
            for call in calls:
                jax.block_until_ready(call(x, weight))
            best = [float("inf")] * 2
            for _ in range(SWEEPS):
                for i, call in enumerate(calls):
                    start = time.perf_counter()
                    jax.block_until_ready([call(x, weight) for _ in range(CALLS)])
                    best[i] = min(best[i], (time.perf_counter() - start) / CALLS)
            result[key][str(rows)] = {"kernel_us": round(best[0] * 1e6, 1), "xla_us": round(best[1] * 1e6, 1)}
    return result
