"""The CPU's products of a few rows by a weight: a C++ kernel (native/row_kernels.h, bound in native/row_matmul.cc)
called through `jax.ffi`.

A decode step on a CPU is a read of every weight, a few activation rows at a time. XLA:CPU runs a one-row product
with a matrix-vector kernel, two or more rows with a GEMM that packs the weight on every call (its time grows with
the rows where a read of the weight would not), and reads int8 or bfloat16 weights slower per value than float32
ones (measured: docs/benchmarks-log.md#cpu-decode-where-a-steps-time-goes-under-xlacpu-and-the-startup-imports-cpu).
The kernel here streams the weight once per four rows as it is stored (float32, bfloat16, or int8 with
per-output-channel scales), widens it in registers, and adds each output element's products in one fixed order: a
row's result is the same bits whatever else shares the pass, so batch-invariant decoding needs no twin of a lone row
on a CPU either.

It is built for this machine's CPU with the C++ compiler (`$CXX`, default g++) by the install (setup.py) into the
package, or else on first use into `~/.cache/mtp_jax/native` (`$XDG_CACHE_HOME` honoured); a library's name follows
its sources, compiler, jaxlib and CPU (kernels/cpu/kernel_build.py). It is registered as an FFI target. Without a
compiler, or with `MTP_JAX_NATIVE=0`, every product stays XLA's (`status()` says why).

An execution plan for one CPU device takes it (`Products.CPU_ROWS`: config/execution_plan.py, kernels/dispatch.py) for
every pass under batch-invariant decoding (prefills too, so that a prompt's rows get the same sums alone and in a
batch), and otherwise passes of at most ROWS_MAX rows (decode steps and verify blocks; a long prefill
keeps XLA's GEMM) in the forms where it was measured faster than XLA's own product on this machine
(kernels/cpu/kernel_choice.py).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.kernels.cpu import kernel_build, kernel_choice
from mtp_jax.ops import matmul_layout
from mtp_jax.ops.rowwise import xla_project
from mtp_jax.ops.stacked_weights import StackedWeight, layer_value
from mtp_jax.parallel.sharding import active_platform, one_device_active
from mtp_jax.quant.blocked_product import quantized_einsum
from mtp_jax.quant.quantized_array import QuantizedArray

TARGET = "mtp_jax_row_matmul"
SYMBOL = "MtpJaxRowMatmul"
ATTENTION_TARGET = "mtp_jax_cache_attention"  # native/cache_attention.cc, same library (cpu_attention.py)
ATTENTION_SYMBOL = "MtpJaxCacheAttention"
ISA_SYMBOL = "MtpJaxRowIsa"  # the ISA level the library was built for
DOT_SYMBOL = "MtpJaxRowIntegerDot"  # how its int8-rows product sums four products
CACHED_BUILDS = 8  # libraries kept in the user's cache (the newest; other environments' builds among them)
ROWS_MAX = 64  # rows per pass that take the kernel outside batch-invariant decoding
DISABLE_ENV = "MTP_JAX_NATIVE"
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)
MAX_LANES = 16  # the widest vector of float32 lanes the kernel is built with (AVX512)
BLOCK_LANES = 16  # a weight read as [G, N, K] with blocks: whole vectors of this many contracting elements a block
_LOCK = threading.Lock()
_REGISTERED: list[Path] = []  # the library whose handlers this process registered
_LEVEL: list[str] = []  # its ISA level and -march
_DOT: list[str] = []  # its integer dot


def build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mtp_jax" / "native"


def _load(path: Path):
    """(the row product's handler, the decode attention's, the ISA level's name, the integer dot's) of the library at
    `path`, or None where it cannot be loaded (truncated, overwritten)."""
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
        isa, dot = getattr(library, ISA_SYMBOL), getattr(library, DOT_SYMBOL)
        isa.restype = dot.restype = ctypes.c_char_p
        return getattr(library, SYMBOL), getattr(library, ATTENTION_SYMBOL), isa().decode(), dot().decode()
    except (OSError, AttributeError):
        return None


def status() -> str:
    """The word "ready" once the kernel is built (or found built) and registered; otherwise why not. Built once per
    process (a caller waits for a build under way in another thread)."""
    with _LOCK:
        return _status_once()


def level() -> str:
    """The ISA level the registered kernel was built for and its -march (e.g. "avx2, -march=x86-64-v3"), or the
    status where none is: for `bench`'s header and `decode`'s summary."""
    state = status()
    return _LEVEL[0] if state == "ready" else state


def library_name() -> str | None:
    """The registered kernel library's file name (a hash of its sources, compiler, jaxlib and CPU), or None where no
    kernel is ready."""
    return _REGISTERED[0].name if status() == "ready" else None


def integer_dot() -> str | None:
    """How the registered kernel's int8-rows product sums a lane's four products ("vpdpbusd", "vpmaddubsw", "sdot";
    "none" where it adds them one at a time), or None where no kernel is ready."""
    return _DOT[0] if status() == "ready" else None


def reset_status() -> None:
    """Forget the status, so that the next `status()` looks again (after a change of $CXX or MTP_JAX_NATIVE)."""
    with _LOCK:
        _status_once.cache_clear()


def prepare() -> None:
    """Build or load the kernel in a background thread (a first run's build then overlaps loading the model). Where
    it wins is measured later, at the first product traced (`choice_table`): timings taken beside a load or a
    compile would measure those."""
    if jax.default_backend() == "cpu":
        threading.Thread(target=status, name="mtp_jax-row-kernel", daemon=True).start()


@functools.cache
def _status_once() -> str:
    if os.environ.get(DISABLE_ENV) == "0":
        return f"off ({DISABLE_ENV}=0)"
    compiler = kernel_build.compiler()
    if shutil.which(compiler) is None:
        return f"off (no C++ compiler {compiler!r})"
    try:
        name = kernel_build.library_name(compiler)
        path = kernel_build.installed_dir() / name  # built by the install
        handlers = _load(path) if path.exists() else None
        if handlers is None:  # else built once into the user's cache
            path = build_dir() / name
            if not path.exists():
                kernel_build.build(compiler, path, Path(jax.ffi.include_dir()))
                kernel_build.prune(path.parent, path, others=CACHED_BUILDS - 1)
            handlers = _load(path)
            if handlers is None:  # a damaged library in the cache (truncated, overwritten): built again
                kernel_build.build(compiler, path, Path(jax.ffi.include_dir()))
                handlers = _load(path)
            if handlers is None:
                raise OSError(f"{path} does not load")
        if not _REGISTERED:  # once per process (a second registration of the name is refused)
            for target, function in zip((TARGET, ATTENTION_TARGET), handlers[:2], strict=True):
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(function), platform="cpu")
            _REGISTERED.append(path)
            _LEVEL.append(f"{handlers[2]}, -march={kernel_build.march()}")
            _DOT.append(handlers[3])
    except (OSError, RuntimeError, subprocess.SubprocessError, importlib.metadata.PackageNotFoundError) as e:
        return f"off ({e})"
    return "ready"


def takes(equation: str, x: jax.Array, weight, invariant: bool) -> bool:
    """Whether x's product with `weight` under `equation` runs here: on a CPU, one device, a float32 / bfloat16 /
    int8 weight, or a quantized one whose scales (float32 or float16) and mins cut the contracting axes into
    contiguous blocks (4-bit values packed or not; read as [G, N, K]: blocks of whole vectors), and (unless
    `invariant`) at most ROWS_MAX rows; a StackedWeight only where its stack is read in place. Builds the kernel on
    first call."""
    if active_platform() != "cpu" or not one_device_active():
        return False
    stacked = isinstance(weight, StackedWeight)
    layer_weight = weight.layer_shapes() if stacked else weight  # shapes and dtypes
    if not jnp.issubdtype(x.dtype, jnp.floating) or not _kernel_weight(layer_weight):
        return False
    lay = matmul_layout.layout(equation, x.shape, layer_weight.shape)
    if isinstance(layer_weight, QuantizedArray) and not _kernel_blocks(lay, layer_weight):
        return False
    if (
        isinstance(layer_weight, QuantizedArray)
        and layer_weight.int8_activations
        and not _int8_rows_layout(lay, layer_weight)
    ):
        return False
    if stacked and not matmul_layout.reads_in_place(lay):
        return False
    if tiled(layer_weight) and not _tiles_fit(lay, layer_weight):
        return False  # XLA's product reads it, in row order
    if not invariant and lay.gmkn[1] > ROWS_MAX:
        return False
    return status() == "ready"


def tiled(weight) -> bool:
    """Whether a weight (or a StackedWeight's layer, as shapes) is stored in the kernel's tile order
    (`quant.row_tiles`)."""
    if isinstance(weight, StackedWeight):
        weight = weight.layer_shapes()
    return isinstance(weight, QuantizedArray) and weight.tile_axes is not None


def _tiles_fit(lay: matmul_layout.Layout, weight: QuantizedArray) -> bool:
    """Whether a product of `lay` reads `weight` (in tile order) as its tiles lie: its matrix in place, the
    contracting and column letters where the weight's `tile_axes` put them."""
    axes, rhs = weight.tile_axes, lay.rhs
    split = len(rhs) - (axes.contracting if axes.columns_first else axes.columns)
    first, second = tuple(rhs[len(rhs) - axes.contracting - axes.columns : split]), tuple(rhs[split:])
    contract, cols = (second, first) if axes.columns_first else (first, second)
    placed = lay.transposed == axes.columns_first and matmul_layout.reads_in_place(lay)
    return placed and contract == lay.contract and cols == lay.cols


def _kernel_weight(weight) -> bool:
    if not isinstance(weight, QuantizedArray):
        return any(weight.dtype == d for d in WEIGHT_DTYPES)
    if weight.packed:
        return weight.values.dtype == jnp.uint8
    scales = weight.scales.dtype
    return weight.values.dtype == jnp.int8 and any(scales == d for d in (jnp.float32, jnp.float16))


def _kernel_blocks(lay: matmul_layout.Layout, weight: QuantizedArray) -> bool:
    kb = matmul_layout.contracting_blocks(lay, weight)
    if kb is None or (weight.packed and not matmul_layout.reads_in_place(lay)):
        return False
    blocked = kb > 1 or weight.mins is not None or weight.scales.dtype != jnp.float32
    return not (blocked and lay.transposed and (lay.gmkn[2] // kb) % BLOCK_LANES)


def _int8_rows_layout(lay: matmul_layout.Layout, weight: QuantizedArray) -> bool:
    """Whether the kernel's int8-rows product (native/row_int8.h, `int8_rows_reads`) reads this weight at every ISA
    level (vectors of at most MAX_LANES lanes), else XLA's product rounds x: blocks of a multiple of 4 contracting
    elements; 4-bit values [K, N] with N a multiple of 2 MAX_LANES in blocks of at most 32 elements; int8 ones
    [K, N] with N a multiple of MAX_LANES, or [N, K] with K a multiple of 4 MAX_LANES and blocks of 32 elements or a
    multiple of 4 MAX_LANES."""
    kb = matmul_layout.contracting_blocks(lay, weight)
    _, _, k, n = lay.gmkn
    if kb is None or (k // kb) % 4:
        return False
    if weight.packed:
        return not lay.transposed and n % (2 * MAX_LANES) == 0 and k // kb <= 32
    if not lay.transposed:
        return n % MAX_LANES == 0
    return k % (4 * MAX_LANES) == 0 and ((k // kb) % (4 * MAX_LANES) == 0 or k // kb == 2 * MAX_LANES)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(equation: str, x: jax.Array, weight) -> jax.Array:
    """jnp.einsum(equation, x, weight) in float32 by the kernel (call only where `takes` said yes); a quantized
    weight is read as stored and its per-channel scales multiply the sums; a StackedWeight's layer is read in place
    from its stack. Differentiable: the gradients are those of XLA's product (training a head through frozen trunk
    projections)."""
    stacked = isinstance(weight, StackedWeight)
    layer_weight = weight.layer_shapes() if stacked else weight
    lay = matmul_layout.layout(equation, x.shape, layer_weight.shape)
    g, m, _, n = lay.gmkn
    operands = functools.partial(_weight_operands, lay)
    if stacked:  # each [L, G, ...] -> [L * G, ...]: the layer's matrices start at layer * G
        values, scales, mins = (a.reshape(-1, *a.shape[2:]) for a in jax.vmap(operands)(weight.stack))
        first = (weight.layer * g).astype(jnp.int32)
    else:
        (values, scales, mins), first = operands(weight), jnp.zeros((), jnp.int32)
    rows = matmul_layout.activations(lay, x)  # [G, M, K]
    if rows.dtype != jnp.bfloat16:  # the kernel widens bfloat16 itself: a widening here could fuse into its
        rows = rows.astype(jnp.float32)  # producer, which may then skip its rounding to bfloat16 in one program only
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((g, m, n), jnp.float32), vmap_method="sequential")
    packed = isinstance(layer_weight, QuantizedArray) and layer_weight.packed
    int8_activations = isinstance(layer_weight, QuantizedArray) and layer_weight.int8_activations
    in_tiles = tiled(layer_weight)  # read as [G, K, N] tiles, whichever way the stored axes lie
    attrs = dict(transposed=np.int64(lay.transposed and not in_tiles), packed=np.int64(packed),
                 int8_rows=np.int64(int8_activations), tiled=np.int64(in_tiles))  # fmt: skip
    product = call(rows, values, scales, mins.astype(scales.dtype), first, **attrs)  # [G, M, N]
    return matmul_layout.output(lay, product)


def _weight_operands(lay: matmul_layout.Layout, weight) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's weight as the kernel reads it: values [G, K, N] or [G, N, K] (as stored), scales [G, KB, N] or
    [G, N, KB], mins as the scales or empty; a weight in tile order as [G, K, N] and [G, KB, N] views of its order."""
    g, _, k, n = lay.gmkn
    if not isinstance(weight, QuantizedArray):
        ones = jnp.ones((g, n, 1) if lay.transposed else (g, 1, n), jnp.float32)
        return matmul_layout.weight(lay, weight), ones, jnp.zeros((0,), jnp.float32)
    if weight.tile_axes is not None:  # bytes in tile order: as [G, K, N] whatever the stored axes' order
        kb = matmul_layout.contracting_blocks(lay, weight)
        values = weight.values.reshape(g, k, n // 2 if weight.packed else n)
        as_blocks = lambda a: jnp.zeros((0,), jnp.float32) if a is None else a.reshape(g, kb, n)
        return values, as_blocks(weight.scales), as_blocks(weight.mins)
    scales = matmul_layout.scales(lay, weight, columns_first=lay.transposed)
    mins = jnp.zeros((0,), jnp.float32)
    if weight.mins is not None:
        mins = matmul_layout.scales(lay, weight, weight.mins, columns_first=lay.transposed)
    return matmul_layout.weight(lay, weight.values, weight.packed), scales, mins


def xla_einsum(equation: str, x: jax.Array, weight) -> jax.Array:
    """The same product by XLA, float32 out (its gradients are the kernel's)."""
    weight = layer_value(weight)
    if isinstance(weight, QuantizedArray):
        return quantized_einsum(equation, x, weight.in_rows())
    return jnp.einsum(equation, x, weight, preferred_element_type=jnp.float32)


def _einsum_forward(equation: str, x: jax.Array, weight):
    return einsum(equation, x, weight), (x, weight)


def _einsum_backward(equation: str, residuals, cotangent):
    _, pullback = jax.vjp(functools.partial(xla_einsum, equation), *residuals)
    return pullback(cotangent)


einsum.defvjp(_einsum_forward, _einsum_backward)


def choice_table() -> dict:
    """Where the kernel beat XLA's products on this machine (kernels/cpu/kernel_choice.py), for the loaded build."""
    if not _REGISTERED:
        return {}
    library = _REGISTERED[0]  # the table is kept beside it where that folder can be written
    folder = library.parent if os.access(library.parent, os.W_OK) else build_dir()
    return kernel_choice.table_for(library, folder, einsum, xla_float32)


def xla_float32(equation: str, x: jax.Array, weight) -> jax.Array:
    return xla_project(equation, x, weight, jnp.float32, invariant=False)


def run_product(equation: str, x: jax.Array, weight, out_dtype) -> jax.Array:
    """The kernel's product in a program lowered for a CPU; XLA's where the same program (traced without a mesh)
    is compiled for another device."""
    native = lambda x, w: einsum(equation, x, w).astype(out_dtype)
    xla = functools.partial(xla_project, equation, out_dtype=out_dtype, invariant=True)  # never dequantized first
    return jax.lax.platform_dependent(x, weight, cpu=native, default=xla)
