"""Which JAX platforms a process starts: without a TPU attached, not libtpu's.

With libtpu installed (the test extra and the tpu extra bring it, for the plans' TPU-topology compiles), JAX starts
the TPU backend in every process that asks for a device, and on a machine without a TPU libtpu prints several lines
of errors first (no accelerator type, no worker hostnames, a source-location trace). Here, before any backend
starts, a process on a machine with no accelerator at all (no TPU device or variables, no GPU device file) asks JAX
for the CPU alone. Compiling for a TPU topology does not need the TPU backend (`jax.experimental.topologies` loads
libtpu itself). A machine with a GPU is left to JAX's own choice (its plugins are found by JAX, not named here), and
so are a user's own JAX_PLATFORMS and a backend already started.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import jax

TPU_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_HOSTNAMES")
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")  # NVIDIA, AMD, WSL


def tpu_attached() -> bool:
    devices = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) or any(os.environ.get(name) for name in TPU_VARIABLES)


def accelerator_attached() -> bool:
    return tpu_attached() or any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def skip_absent_tpu() -> None:
    """Ask JAX for the CPU alone where libtpu is installed and no accelerator is attached (the module's doc)."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if importlib.util.find_spec("libtpu") is None or accelerator_attached():
        return
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # a backend already started: too late to choose
        pass


skip_absent_tpu()
