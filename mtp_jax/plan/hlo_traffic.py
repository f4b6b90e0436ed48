"""The memory traffic of a compiled program, read from its HLO text: bytes read and written per execution, with loop
bodies counted as often as they run.

XLA's cost analysis ("bytes accessed") counts a loop body once, and compiled for TPU its counts of the decode
round did not even grow with the layers (measured on MiMo-7B cut to 2, 3 and 4 layers:
docs/benchmarks-log.md#tpu-plans-every-family-at-full-size-compiled-for-tpu-slices-from-this-cpu-python--m-mtp_jaxplan).
Here each top-level instruction of a computation that runs (ENTRY, loop bodies, branches, called computations; not
the bodies of fusions or reducers) counts:
  - a fusion: each operand by what its fused computation reads of it (only the slices, when every use slices it;
    nothing when it is the buffer an in-place update writes into), plus what its root writes (the update only, for
    a dynamic-update-slice root);
  - dynamic-update-slice and scatter: the update, read and written; slices, gathers and copies: their result, read
    and written;
  - anything else (matmuls, custom calls, collectives, sorts): every operand and the result;
  - on TPU, an operand or result in on-chip memory (memory space `S(1)`, e.g. weights an async slice prefetched):
    nothing more;
  - the routed-experts kernels (kernels/routed_kernel.py, kernels/grouped_kernel.py), whose reads of the expert
    stacks depend on the routing at run time: their small operands and result, plus the experts fetched per call
    times an expert's bytes in each stack: `routed_reads(rows, local experts, slots)` where the caller knows the
    routing's model (routed_floor.expected_experts), else every slot (an upper bound);
  - shape-only instructions (parameters, tuples, bitcasts, async done halves, the loop and call wrappers, TPU's
    `ConcatBitcast` of slices already fetched): nothing.
A conditional counts its costliest branch (one runs: an upper bound).

    hbm_bytes(compiled.as_text())  # bytes one execution moves, per device
    hbm_bytes(compiled.as_text(), "decode_loop")  # bytes one iteration of its loop of that name moves
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mtp_jax.kernels.grouped_kernel import KERNEL_NAME as GROUPED_KERNEL_NAME
from mtp_jax.kernels.routed_kernel import KERNEL_NAME
from mtp_jax.plan.hlo_text import (
    INSTRUCTION,
    OPERAND,
    array_bytes,
    array_dims,
    callees,
    computations,
    instructions,
    named_loop,
    trip_count,
)

_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional", "after-all",
    "partition-id", "replica-id", "opt-barrier", "copy-done", "slice-done", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "async-done", "send-done", "recv-done", "add-dependency", "iota",
}  # fmt: skip
_SLICES = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
_REDUCERS = {"reduce", "reduce-window", "scatter", "sort", "map", "select-and-scatter", "all-reduce", "reduce-scatter"}
_UPDATE_OPERAND = {"dynamic-update-slice": 1, "scatter": 2}
_TYPED_ARRAY = re.compile(r"([a-z][a-z0-9]*\[[0-9,]*\])(\{[^}]*\})?")  # an array type and its layout


ROUTED_MIX_OPERAND = 4  # the small-pass kernel's operands: layer, used experts, count, x [M, D], mix [U, M, 1], stacks
RoutedReads = Callable[[int, int, int], float]  # (rows, local experts, slots) -> experts fetched per call


def hbm_bytes(hlo: str, loop: str | None = None, routed_reads: RoutedReads | None = None) -> int:
    """Bytes the program in `hlo` (compiled HLO text) reads and writes per execution (see the module doc); with
    `loop`, per iteration of its loop of that name (`hlo_text.named_loop`: a decode loop after what it prepares).
    `routed_reads`: the experts the routed-experts kernel fetches per call (None: every slot)."""
    bodies, entry = computations(hlo)
    tables = {name: _parse(lines) for name, lines in bodies.items()}
    types = {name: result for table in tables.values() for name, (result, _, _, _) in table.items()}
    count = _Traffic(bodies, tables, types, routed_reads)
    roots = named_loop(bodies, entry, loop) if loop is not None else (entry,)
    return sum(count.bytes_of(root) for root in roots)


class _Traffic:
    """Bytes of one execution of a computation, with everything it runs: loop bodies times their trip counts, one
    conditional branch (the costliest) per conditional; fused and wrapped computations are their instruction's."""

    def __init__(self, bodies: dict[str, list[str]], tables: dict, types: dict, routed_reads: RoutedReads | None):
        self.bodies, self.tables, self.types, self.routed_reads = bodies, tables, types, routed_reads
        self.inner = _inner_computations(tables)
        self.memo: dict[str, int] = {}

    def bytes_of(self, name: str, depth: int = 0) -> int:
        if name in self.memo:
            return self.memo[name]
        if depth > 64:  # HLO computations form a DAG; a deeper chain means a parse went wrong
            raise ValueError(f"HLO call chain through {name} deeper than 64")
        table, total = self.tables[name], 0
        raw = instructions(self.bodies[name])
        for line in self.bodies[name]:
            match = INSTRUCTION.match(line)
            if not match:
                continue
            result, op, operands, rest = table[match.group(1)]
            if op == "custom-call" and match.group(1).startswith(KERNEL_NAME):
                total += _routed_kernel_bytes(match.group(1), result, operands, self.types, self.routed_reads)
            else:
                total += _instruction_bytes(result, op, operands, rest, self.types, self.tables)
            called = [c for c in callees(line) if c in self.bodies and c not in self.inner]
            if op == "conditional" and called:  # one branch runs: the costliest bounds it
                total += max(self.bytes_of(c, depth + 1) for c in called)
            else:
                times = trip_count(line, raw, self.bodies) if op == "while" else 1
                total += times * sum(self.bytes_of(c, depth + 1) for c in called)
        self.memo[name] = total
        return total


def _parse(lines: list[str]) -> dict[str, tuple[str, str, list[str], str]]:
    """{instruction: (result type, opcode, operand names, the rest of its line from its operands on)}, the ROOT
    instruction last."""
    table, root = {}, None
    for line in lines:
        match = INSTRUCTION.match(line)
        if match:
            name, result, op, rest = match.groups()
            table[name] = (result, op, OPERAND.findall(rest.partition(")")[0]), rest)
            if line.lstrip().startswith("ROOT"):
                root = name
    if root is not None:
        table[root] = table.pop(root)
    return table


def _callee(rest: str, key: str) -> str | None:
    marker = f"{key}="
    if marker not in rest:
        return None
    return rest.split(marker, 1)[1].split(",")[0].split("}")[0].strip().lstrip("%")


def _inner_computations(tables: dict) -> set[str]:
    """Computations that run inside one instruction (fusion bodies, reducers, async-wrapped ops): their
    instructions are that instruction's, not traffic of their own."""
    inner = set()
    for table in tables.values():
        for _, op, _, rest in table.values():
            if op == "fusion" or op.endswith("-start"):
                inner.add(_callee(rest, "calls"))
            if op in _REDUCERS:
                inner.add(_callee(rest, "to_apply"))
    return inner - {None}


def _instruction_bytes(result: str, op: str, operands: list[str], rest: str, types: dict, tables: dict) -> int:
    if op in _FREE or 'custom_call_target="ConcatBitcast"' in rest:  # TPU: slices already fetched, joined in place
        return 0
    if op in _IN_PLACE:
        return 2 * array_bytes(types.get(operands[_UPDATE_OPERAND[op]], ""))
    if op in _SLICES or op == "copy":
        return 2 * array_bytes(result)
    if op in ("copy-start", "slice-start", "dynamic-slice-start"):
        return _async_copy_bytes(result)
    if op == "fusion":
        fused = tables.get(_callee(rest, "calls") or "")
        if fused is not None:
            return _fusion_bytes(fused, operands, types, tables)
    return _hbm(result) + sum(_hbm(types.get(o, "")) for o in operands)


def _routed_kernel_bytes(
    name: str, result: str, operands: list[str], types: dict, routed_reads: RoutedReads | None
) -> int:
    """One call of a routed-experts kernel: its small operands and result whole, and of each stack [L, E, ...]
    the experts it fetches (see the module doc). The small-pass kernel's slots are its mix operand's [U, M, 1]; the
    grouped kernel's, every local expert (it fetches each used one once)."""
    ranks = [len(array_dims(types.get(o, ""))) for o in operands]
    small = [o for o, rank in zip(operands, ranks, strict=True) if rank < 4]
    stacks = [o for o, rank in zip(operands, ranks, strict=True) if rank >= 4]
    rows = array_dims(result)[0]
    grouped = name.startswith(GROUPED_KERNEL_NAME)
    total = _hbm(result) + sum(_hbm(types.get(o, "")) for o in small)
    for stack in stacks:
        layers, local, *_ = array_dims(types[stack])
        slots = local if grouped else array_dims(types.get(small[ROUTED_MIX_OPERAND], ""))[0]
        fetched = slots if routed_reads is None else routed_reads(rows, local, slots)
        total += fetched * _hbm(types[stack]) / (layers * local)
    return int(total)


def _async_copy_bytes(result: str) -> int:
    """An asynchronous copy or slice, from its result tuple ((operand), destination, context) or (destination,
    source, context): the destination read from memory, and written unless it lands in on-chip memory (`S(1)`)."""
    arrays = _TYPED_ARRAY.findall(result)
    destination = "".join(arrays[1] if result.lstrip().startswith("((") else arrays[0]) if arrays else ""
    return array_bytes(destination) * (1 if "S(1)" in destination else 2)


def _fusion_bytes(fused: dict, operands: list[str], types: dict, tables: dict) -> int:
    """What a fusion reads of its operands and writes of its result, from its fused computation `fused`."""
    read = 0
    for name, number in _parameters(fused).items():
        whole = _hbm(types.get(operands[number], "")) if number < len(operands) else 0
        read += min(whole, _read_of(name, fused, tables))
    return read + _written(_root(fused), fused)


def _hbm(array_type: str) -> int:
    """Bytes of an array type, 0 when it lives in on-chip memory (TPU's VMEM, memory space `S(1)`)."""
    return 0 if "S(1)" in array_type else array_bytes(array_type)


def _parameters(fused: dict) -> dict[str, int]:
    """{parameter instruction: its parameter number}."""
    return {name: int(rest.partition(")")[0]) for name, (_, op, _, rest) in fused.items() if op == "parameter"}


def _read_of(name: str, fused: dict, tables: dict, depth: int = 0) -> int:
    """Bytes the fused computation `fused` reads of its value `name`: the slices' results where it is only sliced
    (through bitcasts and nested fusions), nothing where it is the buffer its in-place root updates, all of it
    otherwise."""
    whole = array_bytes(fused[name][0])
    users = [
        (user, position) for user, (_, _, args, _) in fused.items() for position, arg in enumerate(args) if arg == name
    ]
    if not users or depth > 8:
        return whole
    total = 0
    for user, position in users:
        _, op, _, rest = fused[user]
        nested = tables.get(_callee(rest, "calls") or "") if op == "fusion" else None
        if op in _SLICES and position == 0:
            total += array_bytes(fused[user][0])
        elif op == "dynamic-update-slice" and position == 0 and user == _root(fused):
            continue
        elif op == "bitcast":
            total += _read_of(user, fused, tables, depth + 1)
        elif nested is not None:
            inner = next((p for p, number in _parameters(nested).items() if number == position), None)
            total += whole if inner is None else _read_of(inner, nested, tables, depth + 1)
        else:
            return whole
    return min(total, whole)


def _root(fused: dict) -> str:
    """The fused computation's ROOT instruction (`_parse` puts it last)."""
    return next(reversed(fused))


def _written(root: str, fused: dict) -> int:
    result, op, args, _ = fused[root]
    if op == "dynamic-update-slice":
        return array_bytes(fused[args[1]][0]) if args[1] in fused else _hbm(result)
    if op == "tuple":
        return sum(_written(arg, fused) for arg in args if arg in fused)
    return _hbm(result)
