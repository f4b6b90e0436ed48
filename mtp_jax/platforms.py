"""Which JAX platforms a process starts: without a TPU attached, not libtpu's.

With libtpu installed (the test extra and the tpu extra bring it, for the plans' TPU-topology compiles), JAX starts
the TPU backend in every process that asks for a device, and on a machine without a TPU libtpu prints several lines
of errors first (no accelerator type, no worker hostnames, a source-location trace). Here, before any backend
starts, a process with no TPU attached (no /dev/accel* or /dev/vfio device, no TPU variables) asks JAX for the
platforms it has instead: a GPU's where its plugin and devices are there, and the CPU. Compiling for a TPU topology
does not need the TPU backend (`jax.experimental.topologies` loads libtpu itself). A user's own JAX_PLATFORMS, or a
backend already started, is left as it is.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import jax

TPU_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_HOSTNAMES")
GPU_PLUGINS = {  # platform: (plugin modules, device files)
    "cuda": (("jax_cuda12_plugin", "jax_cuda13_plugin"), ("/dev/nvidiactl",)),
    "rocm": (("jax_rocm60_plugin", "jax_rocm7_plugin"), ("/dev/kfd",)),
}


def tpu_attached() -> bool:
    devices = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(devices) or any(os.environ.get(name) for name in TPU_VARIABLES)


def platforms_without_tpu() -> str:
    """The platforms this machine has, TPU aside, as JAX_PLATFORMS spells them ("cuda,cpu", "cpu")."""
    found = [
        name
        for name, (plugins, files) in GPU_PLUGINS.items()
        if any(importlib.util.find_spec(p) for p in plugins) and any(os.path.exists(f) for f in files)
    ]
    return ",".join([*found, "cpu"])


def skip_absent_tpu() -> None:
    """Ask JAX not to start libtpu where no TPU is attached (see the module's doc)."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if importlib.util.find_spec("libtpu") is None or tpu_attached():
        return
    try:
        jax.config.update("jax_platforms", platforms_without_tpu())
    except RuntimeError:  # a backend already started: too late to choose
        pass


skip_absent_tpu()
