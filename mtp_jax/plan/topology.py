"""Device topologies to compile for without running on them: TPU slices (through libtpu's topology descriptions), a
node of N GPUs of the attached GPU's kind (XLA:GPU cross-compiling for compile-only devices), and N host CPU devices
standing in for a GPU node; each with the public per-chip figures a plan projects step times from.

    target = topology.resolve("v5e:2x4")   # 8 TPU v5e chips: their devices, HBM, bandwidths, peak flops
    target = topology.resolve("gpu:8")   # 8 GPUs like the one attached (needs one NVIDIA GPU, not 8)
    target = topology.resolve("cpu:8", capacity_gib=131)   # 8 host devices, 131 GiB each (an H200 node)

TPU figures per chip (Google Cloud's TPU pages, read 2026-11-25; ICI is the bidirectional figure per chip, v4's from
the TPU v4 paper: six links of 50 GB/s): see docs/benchmarks.md#tpu-plans.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
from jax._src.lib import xla_client  # the attached GPU's compile target (get_topology_for_devices)

from mtp_jax.runtime.errors import UserError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """Public per-chip figures: HBM capacity, HBM bandwidth, bf16 peak, inter-chip interconnect bandwidth."""

    name: str
    hbm_gib: float
    hbm_gbps: float  # GB/s
    bf16_tflops: float
    ici_gbps: float  # GB/s, bidirectional, per chip


CHIPS = {
    "v4": Chip("TPU v4", 32, 1200, 275, 300),
    "v5e": Chip("TPU v5e", 16, 819, 197, 400),
    "v5p": Chip("TPU v5p", 95, 2765, 459, 1200),
    "v6e": Chip("TPU v6e", 32, 1638, 918, 800),
}
# A host-CPU stand-in for a GPU node: the device's memory comes from --capacity-gib; bandwidths of an H100 SXM
# (3.35 TB/s HBM, 989 dense bf16 TFLOP/s, 450 GB/s NVLink each way) so that projections read as a GPU node's.
CPU_STANDIN = Chip("host CPU device (GPU stand-in: H100 SXM figures)", 80, 3350, 989, 900)
# NVIDIA's datasheet figures for the SXM parts (80 and 141 GB of HBM, in GiB; dense bf16; NVLink 4 at 900 GB/s
# bidirectional). Not the attached device's allocator limit: JAX's takes 75% of the memory by default.
GPUS = {
    "H100": Chip("NVIDIA H100 SXM", 80e9 / 1024**3, 3350, 989, 900),
    "H200": Chip("NVIDIA H200 SXM", 141e9 / 1024**3, 4800, 989, 900),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """What a plan compiles for: the devices, the chip they belong to and each device's memory."""

    name: str
    chip: Chip
    devices: tuple
    num_chips: int
    capacity_bytes: int  # per device

    @property
    def devices_per_chip(self) -> int:
        return len(self.devices) // self.num_chips


def _tpu_bounds(dims: list[int]) -> dict:
    """libtpu's default host is 2x2x1 chips; a smaller slice (Colab's v5e-1, a v5e:2x1) needs its own bounds."""
    padded = [*dims, 1, 1, 1][:3]
    if padded[0] % 2 or padded[1] % 2:
        return {"chips_per_host_bounds": tuple(padded)}
    return {}


def resolve(name: str, capacity_gib: float | None = None) -> Target:
    """The devices and figures of a topology name: `v5e:2x4`, `v5p:4x4x4`, `v6e:4x4`, `v4:2x2x2`, or `cpu:N`."""
    generation, _, shape = name.partition(":")
    try:
        dims = [int(d) for d in shape.split("x")]
    except ValueError:
        dims = []
    if generation == "cpu":
        return _cpu_target(name, dims, capacity_gib)
    if generation == "gpu":
        return _gpu_target(name, dims, capacity_gib)
    if generation not in CHIPS or not dims or min(dims) < 1:
        raise UserError(
            f"bad topology {name!r}: expected GENERATION:AxB[xC] with GENERATION one of {', '.join(CHIPS)} "
            "(e.g. v5e:2x4, v5p:4x4x4), gpu:N or cpu:N"
        )
    try:
        devices = _tpu_devices(name, tuple(sorted(_tpu_bounds(dims).items())))
    except ImportError as e:
        raise UserError(f"compiling for {name} needs libtpu: pip install -e '.[tpu]' ({e})") from e
    except Exception as e:  # libtpu's own refusal: first line only
        raise UserError(f"libtpu refused topology {name!r}: {str(e).splitlines()[0]}") from e
    chip = CHIPS[generation]
    num_chips = math.prod(dims)
    per_device = chip.hbm_gib * GIB * num_chips / len(devices)
    capacity = int((capacity_gib * GIB) if capacity_gib else per_device)
    return Target(name, chip, devices, num_chips, capacity)


@functools.cache
def _tpu_devices(name: str, bounds: tuple) -> tuple:
    """The devices of a TPU topology, described once per process: programs compiled for one description's devices
    take only those devices' shardings, so plans in one process share them (and `planning.compiled` its programs)."""
    from jax.experimental import topologies  # needs libtpu, an optional dependency (the tpu extra)

    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name, **dict(bounds)).devices)


def _cpu_target(name: str, dims: list[int], capacity_gib: float | None) -> Target:
    if len(dims) != 1 or dims[0] < 1:
        raise UserError(f"bad topology {name!r}: expected cpu:N with N >= 1 host devices")
    (count,) = dims
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise UserError(
            f"{name} needs {count} host CPU devices but JAX started with {len(cpus)}: run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} (python -m mtp_jax.plan sets it itself)"
        )
    chip = dataclasses.replace(CPU_STANDIN, hbm_gib=capacity_gib or CPU_STANDIN.hbm_gib)
    return Target(name, chip, tuple(cpus[:count]), count, int(chip.hbm_gib * GIB))


def _gpu_target(name: str, dims: list[int], capacity_gib: float | None) -> Target:
    """N compile-only GPUs of the attached one's kind, one node (`1x1xN`): XLA:GPU compiles the sharded program for
    them as it would for a real node, from a machine with a single GPU."""
    if len(dims) != 1 or dims[0] < 1:
        raise UserError(f"bad topology {name!r}: expected gpu:N with N >= 1 GPUs")
    (count,) = dims
    try:
        attached = jax.devices("gpu")
    except RuntimeError:
        attached = []
    if not attached:
        raise UserError(f"{name} compiles for GPUs like an attached one, and JAX sees no GPU here")
    try:
        from jax.experimental import topologies

        target_config = xla_client.get_topology_for_devices(attached).target_config
        desc = topologies.get_topology_desc(platform="cuda", target_config=target_config, topology=f"1x1x{count}")
    except Exception as e:  # this jaxlib cannot describe the node: first line only
        raise UserError(f"cannot describe {name} for {attached[0].device_kind}: {str(e).splitlines()[0]}") from e
    kind = attached[0].device_kind
    base = next((chip for key, chip in GPUS.items() if key in kind), dataclasses.replace(GPUS["H100"], name=kind))
    chip = dataclasses.replace(base, hbm_gib=capacity_gib or base.hbm_gib)
    return Target(name, chip, tuple(desc.devices), count, int(chip.hbm_gib * GIB))


def request_host_devices(name: str) -> None:
    """Before JAX starts its CPU backend: ask for the host devices a `cpu:N` topology needs."""
    generation, _, count = name.partition(":")
    if generation == "cpu" and count.isdigit():
        flag = f"--xla_force_host_platform_device_count={int(count)}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
