"""Whether a decode's caches fit beside the parameters, checked before anything is allocated or compiled: the bytes
of each device of the model against its memory (one accelerator's limit, or the machine's RAM on a CPU)."""

from __future__ import annotations

import os

import jax
from flax import nnx

from mtp_jax.models.causal_lm import CausalLM


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def shortfall(model: CausalLM, cache_bytes: int, caches: str = "the caches") -> str | None:
    """None when `cache_bytes` (the whole decode state, over every device) and the parameters fit in the model's
    devices; else what they need against what there is, as the end of a sentence."""
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    devices = 1 if model.sharding_rules is None else model.sharding_rules.mesh.size
    need = cache_bytes + param_bytes
    capacity, where = memory_capacity(model)
    if capacity is None or need / devices <= capacity:
        return None
    spread = f" ({gib(need / devices)} on each of {devices} devices)" if devices > 1 else ""
    return (f"{caches} ({gib(cache_bytes)}) and the parameters ({gib(param_bytes)}) need {gib(need)}{spread}, more "
            f"than the {gib(capacity)} of {where}")  # fmt: skip


def memory_capacity(model: CausalLM) -> tuple[int | None, str]:
    """The bytes one device of the model may hold, and what they are: the machine's RAM, shared by this process's CPU
    devices, or one accelerator's memory limit (None where the platform does not say)."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        return (device.memory_stats() or {}).get("bytes_limit"), f"one {device.device_kind}"
    mesh = None if model.sharding_rules is None else model.sharding_rules.mesh
    local = 1 if mesh is None else sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None, "this machine"
    return ram // local, "this machine's RAM" + (f" shared by {local} devices" if local > 1 else "")
