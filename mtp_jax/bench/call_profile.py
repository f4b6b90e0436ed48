"""Where a decode round's time goes, call by call: the bench's timed round (`RoundTimer`: rounds in one `fori_loop`
over the prefilled state) traced with `jax.profiler`, each trace event matched to the HLO instruction of the same
name in the compiled program, and the microseconds a round summed by kind of call: each custom call target (the CPU
kernel's products and attention) apart for the MTP layer's calls and the rest, and XLA's own instructions (fusions,
copies). A trace inflates every call a little; compare kinds and rounds with each other, not with untraced times.

    from mtp_jax.bench.call_profile import round_calls, by_kind
    by_kind(round_calls(model, prompt_ids, num_draft=1))  # {"mtp_jax_row_matmul": 4429.2, ...}
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile

import jax
import numpy as np

from mtp_jax.decode.round_timing import RoundTimer
from mtp_jax.plan import hlo_text

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
MTP_SCOPE = "/mtp/"  # in the op_name of every instruction the MTP layer's module traced


@dataclasses.dataclass(frozen=True)
class CallTime:
    """One HLO instruction of the round's program: its name, its opcode or custom call target, its source op_name,
    and its traced microseconds and calls a round."""

    name: str
    kind: str
    op_name: str
    microseconds: float
    calls: float


def instructions(text: str) -> dict[str, tuple[str, str]]:
    """A compiled program's text -> {instruction name: (opcode or custom call target, op_name)}."""
    found = {}
    for name, (_, opcode, rest) in hlo_text.instructions(text.splitlines()).items():
        target, op_name = _TARGET.search(rest), _OP_NAME.search(rest)
        found[name] = (target.group(1) if target else opcode, op_name.group(1) if op_name else "")
    return found


def round_calls(model, prompt_ids: np.ndarray, num_draft: int, rounds: int = 32, max_new_tokens: int = 64
                ) -> list[CallTime]:  # fmt: skip
    """The traced calls of a greedy round with `num_draft` drafts from the prefill of `prompt_ids` ([B, W], no
    padding), per round, slowest first."""
    ids = np.asarray(prompt_ids, np.int32)
    timer = RoundTimer(model, ids, np.full((ids.shape[0],), ids.shape[1]), max_new_tokens, iterations=rounds)
    run, count, program_text = timer.round_program(num_draft)
    named = instructions(program_text)
    with tempfile.TemporaryDirectory(prefix="mtp-jax-trace-") as folder:
        jax.profiler.start_trace(folder)
        jax.block_until_ready(run())
        jax.profiler.stop_trace()
        trace = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))[-1]
        profile = jax.profiler.ProfileData.from_file(trace)
    nanoseconds, calls = collections.Counter(), collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in named:
                    nanoseconds[event.name] += event.duration_ns
                    calls[event.name] += 1
    found = [CallTime(name, *named[name], ns / count / 1e3, calls[name] / count) for name, ns in nanoseconds.items()]
    return sorted(found, key=lambda c: -c.microseconds)


def by_kind(calls: list[CallTime]) -> dict[str, float]:
    """Microseconds a round by kind: each custom call target (`:mtp` for the MTP layer's), and "xla" for the rest."""
    kinds = collections.Counter()
    for call in calls:
        custom = call.kind.startswith("mtp_jax")
        kinds[(call.kind + (":mtp" if MTP_SCOPE in call.op_name else "")) if custom else "xla"] += call.microseconds
    return dict(kinds.most_common())
