"""Shared fixtures: the real default model (SmolLM2-135M-Instruct GGUF), ours and transformers', loaded once."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile

# Tests run tiny models, where XLA's compile time dwarfs run time: compile with most optimizations off (also in the
# subprocesses and notebook kernels the tests start, which inherit the environment), except where a test runs the
# real default model (`optimized_compiles`). Benchmarks never run this way.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# libtpu is installed for the plans' TPU-topology compiles: JAX itself stays on the host CPU (no TPU runtime is
# started or locked), and test workers may each load libtpu's compiler at once.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The command-line tools keep compiled programs in the user's cache folder; tests compile into no persistent cache
# (tests/loading/test_warm_start.py turns it on in a folder of its own).
os.environ.setdefault("MTP_JAX_NO_COMPILE_CACHE", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The CPU row kernel takes every product it can run: where it beat XLA's form is a timing
# (kernels/cpu/kernel_choice.py), which under a busy test run and unoptimized compiles would say anything
# (tests/kernels/test_kernel_choice.py turns it on).
os.environ.setdefault("MTP_JAX_KERNEL_CHOICE", "0")

import jax
import pytest

from mtp_jax.loading.default_model import GGUF_ENV, default_gguf_path
from mtp_jax.runtime.cache_folder import CACHE_ENV
from mtp_jax.runtime.errors import UserError

# XLA:CPU's older fusion emitters compile these programs in about 60% of the time the MLIR fusion emitters take
# (tiny models' generate programs, plain and with drafts: 5.3-5.8 s against 8.5-8.8 s for four; the suite 825 s
# against 1341 s).
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
SESSION_CACHE: str | None = None  # the cache folder this session made (pytest_sessionstart), removed at its end


def pytest_configure(config):
    """Ask for FAST_COMPILE_FLAG before any test starts JAX's backend, in the first process only (test workers,
    children and notebook kernels inherit it), and only where this jaxlib's XLA knows the flag: an unknown flag would
    abort every process."""
    if hasattr(config, "workerinput") or "--xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", ""):
        return
    flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    if subprocess.run(probe, env={**os.environ, "XLA_FLAGS": flags}, capture_output=True).returncode == 0:
        os.environ["XLA_FLAGS"] = flags


def pytest_sessionstart(session):
    """Fetch the default model and build the CPU row kernel once, before any test worker starts (xdist workers
    would each do both at once). Then point the tests, their workers and the processes they start at that GGUF and
    at a cache folder of this session's own: what the tools keep there (the default drafting's round costs, the
    default model's conversion, compiled executables) is measured or built under a busy test run and unoptimized
    compiles, and must not land in the user's cache, nor be read from it."""
    if hasattr(session.config, "workerinput"):
        return
    from mtp_jax.kernels.cpu import cpu_rows

    cpu_rows.status()  # a build failure is a status the tests read, not an error here

    try:
        os.environ.setdefault(GGUF_ENV, default_gguf_path())
    except UserError:
        pass  # the smollm2_path fixture reports it where a test needs the model
    if CACHE_ENV not in os.environ:
        global SESSION_CACHE
        SESSION_CACHE = tempfile.mkdtemp(prefix="mtp_jax-tests-")
        os.environ[CACHE_ENV] = SESSION_CACHE


def pytest_sessionfinish(session):
    if SESSION_CACHE is not None and not hasattr(session.config, "workerinput"):
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    `generate` and friends are module-level jits keyed by the model's graphdef, so every tiny model a test builds
    keeps its programs cached for the life of the process. XLA CPU maps each program's JIT code into a few memory
    regions; a test worker that ran a dozen modules reached the kernel's 65530-mapping limit (vm.max_map_count),
    the next JIT link failed ("Failed to materialize symbols") and the error's C++ throw segfaulted in libgcc's
    unwinder. Programs are still shared within a module."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model's GGUF; CI must have it (its install step fetches it), elsewhere a missing copy skips."""
    try:
        return default_gguf_path()
    except UserError as e:
        if os.environ.get("CI"):
            pytest.fail(f"default model unavailable in CI: {e}")
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """transformers' float32 model of the same GGUF (dequantized by transformers itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_model(smollm2_path):
    """Our model and tokenizer of the default GGUF, float32, its activations unrounded (the model transformers runs:
    `activations="auto"` rounds them to int8 on a CPU with integer dot products)."""
    from mtp_jax.loading import checkpoint

    return checkpoint.load(smollm2_path, dtype="float32", activations="float")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops: torch's thread pool only adds spin-waiting (much of it when the cores are shared)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def optimized_compiles():
    """XLA's optimizations back on: a 135M-parameter model runs several times slower without them, far more than
    they add to its compile time."""
    import jax

    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
