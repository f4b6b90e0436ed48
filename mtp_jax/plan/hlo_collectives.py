"""The collectives of a compiled program, read from its HLO text, each counted as often as it runs.

A collective inside a loop body (the scan over layers, the chunks of attention) runs once per iteration: every
computation's executions are propagated from ENTRY through while loops (times their `known_trip_count`), calls,
fusions, conditionals (each branch counted as if taken: an upper bound) and async wrappers.

    for c in collectives(compiled.as_text()):
        print(c.kind, c.operand_bytes, c.result_bytes, c.count)
"""

from __future__ import annotations

import dataclasses

from mtp_jax.plan.hlo_text import INSTRUCTION, OPERAND, array_bytes, loop_runs

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind and shape of collective: bytes of its operands and of its result per execution, executions."""

    kind: str
    shape: str  # the result's HLO type, e.g. bf16[8,1,7168]
    operand_bytes: int
    result_bytes: int
    count: int

    @property
    def moved_bytes(self) -> int:
        """The larger side per execution, times executions: a bound on what crosses the interconnect."""
        return max(self.operand_bytes, self.result_bytes) * self.count


def collectives(hlo: str, loop: str | None = None) -> list[Collective]:
    """Every collective of the program in `hlo` (compiled HLO text), grouped by kind and result type, largest total
    first, counted per execution (with `loop`: per iteration of its loop of that name, `hlo_text.loop_runs`).
    Asynchronous pairs count once (the collective, not its start or done wrappers)."""
    bodies, runs = loop_runs(hlo, loop)
    parsed = [m for lines in bodies.values() for m in map(INSTRUCTION.match, lines) if m]
    result_bytes = {m.group(1): array_bytes(m.group(2)) for m in parsed}  # instruction name -> bytes of its result
    found: dict[tuple[str, str], list[int]] = {}
    for name, lines in bodies.items():
        for line in lines:
            instruction = INSTRUCTION.match(line)
            if not runs[name] or not instruction:
                continue
            _, result, op, rest = instruction.groups()
            kind = op.removesuffix("-start")
            if kind not in KINDS:
                continue
            operands = rest.split(")")[0]
            operand_bytes = sum(result_bytes.get(o, 0) for o in OPERAND.findall(operands))
            shape = result.split("{")[0].strip() if not result.startswith("(") else result
            counts = found.setdefault((kind, shape), [operand_bytes, array_bytes(result), 0])
            counts[2] += runs[name]
    out = [Collective(kind, shape, ob, rb, n) for (kind, shape), (ob, rb, n) in found.items()]
    return sorted(out, key=lambda c: -c.moved_bytes)
