"""What a benchmark result names about where it ran: the command, the device and CPU, the execution plan, the
versions, the date."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform

import jax

from mtp_jax.config import execution_plan
from mtp_jax.decode.stats import describe_device
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.quant.int8_activations import has_int8_activations


def metadata(args, label: str, dtype: str, notes: list[str], model) -> dict:
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    plan = planned(model, args.invariant)
    return {
        "command": args.command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": describe_device(),
        "host": f"{cpu_name()} ({platform.machine()}), {os.cpu_count()} cores",
        "cpu_kernel": cpu_rows.level() if jax.default_backend() == "cpu" else "not used (not a CPU)",
        "execution_plan": plan.as_dict(),
        "execution_plan_summary": plan.summary(),
        "versions": {p: version(p) for p in ("jax", "jaxlib", "flax", "torch", "transformers")},
        "model": label,
        "dtype": dtype,
        "prompts": args.prompts_file or "built-in",
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "invariant": args.invariant,
        "invariance_cost": args.invariance_cost,
        "notes": notes,
    }


def header_lines(meta: dict) -> list[str]:
    """The first lines of a bench table's markdown: command, date, device and host, versions."""
    versions = ", ".join(f"{name} {v}" for name, v in meta["versions"].items())
    return [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}; host: {meta['host']}; CPU row kernel: {meta.get('cpu_kernel', '-')}",
        f"- execution plan: {meta.get('execution_plan_summary', '-')}",
        f"- versions: {versions}",
    ]


def planned(model, invariant: bool) -> execution_plan.ExecutionPlan:
    """The plan `generate` resolves for `model` here (batch-invariant where asked or where its activations are
    rounded to int8, as it decodes such a model)."""
    return traced_plan.resolve(model.sharding_rules, invariant or has_int8_activations(model))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return platform.processor() or "cpu"
