"""Reading compiled HLO text: array bytes of a type, the computations and their instructions, and how many times
each computation runs per execution of the program (while loops times their trip counts, calls, fusions, conditional
branches each counted as if taken). Shared by `hlo_collectives` and `hlo_traffic`."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
OPERAND = re.compile(r"%([\w.\-]+)")
CALLEES = re.compile(r"\b(?:condition|body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def array_bytes(text: str) -> int:
    """Bytes of every array type in `text` (a type or a tuple of types), e.g. `(bf16[2,3], f32[4])` -> 28."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _BYTES:
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            total += size * _BYTES[dtype]
    return int(total)


def array_dims(text: str) -> list[int]:
    """The dimensions of the first array type in `text`, e.g. `bf16[2,3]{1,0}` -> [2, 3] (none: [])."""
    match = _ARRAY.search(text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines} and the ENTRY computation's name. A computation starts with an
    unindented header line ending in `{` and ends with an unindented `}`."""
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            header = line.removeprefix("ENTRY").strip()
            current = header.split()[0].lstrip("%")
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(line)
    return bodies, entry


def instructions(lines: list[str]) -> dict[str, tuple[str, str, str]]:
    """{instruction name: (result type, opcode, the rest of its line)} of one computation."""
    return {m.group(1): m.group(2, 3, 4) for m in map(INSTRUCTION.match, lines) if m}


def constant_value(name: str, table: dict, hops: int = 4) -> int | None:
    """The integer value of `name` when it is a scalar constant (through copies and bitcasts)."""
    while hops and name in table:
        _, op, rest = table[name]
        if op == "constant":
            value = rest.split(")")[0]
            return int(value) if value.lstrip("-").isdigit() else None
        if op not in ("copy", "bitcast", "convert"):
            return None
        name, hops = OPERAND.findall(rest.split(")")[0])[0], hops - 1
    return None


def trip_count(line: str, caller: dict, bodies: dict[str, list[str]]) -> int:
    """Iterations of the while loop on `line`: XLA's `known_trip_count` when annotated, else read off its condition
    (`induction < constant`, the induction variable's start traced to a constant in the caller, 0 if not: JAX's
    loops count from 0 in steps of 1); 1 when the condition has another form."""
    known = _TRIP_COUNT.search(line)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", line)
    if not condition or condition.group(1) not in bodies:
        return 1
    cond = instructions(bodies[condition.group(1)])
    root = next((rest for _, op, rest in cond.values() if op == "compare" and "direction=LT" in rest), None)
    if root is None:
        return 1
    induction, bound = OPERAND.findall(root.split(")")[0])[:2]
    limit = constant_value(bound, cond)
    index = re.search(r"index=(\d+)", cond.get(induction, ("", "", ""))[2])
    if limit is None or index is None:
        return 1
    start = 0
    operand = OPERAND.findall(line.split(" while(")[1].split(")")[0])
    if operand and operand[0] in caller and caller[operand[0]][1] == "tuple":
        elements = OPERAND.findall(caller[operand[0]][2].split(")")[0])
        if int(index.group(1)) < len(elements):
            start = constant_value(elements[int(index.group(1))], caller) or 0
    return max(limit - start, 0)


def callees(line: str) -> list[str]:
    """The computations an instruction line calls: loop condition and body, reducers, fused and wrapped
    computations, conditional branches."""
    found = CALLEES.findall(line)
    for branches in _BRANCHES.findall(line):
        found += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
    return found


def named_loop(bodies: dict[str, list[str]], entry: str, loop: str) -> tuple[str, str]:
    """(condition, body) of the ENTRY computation's one while loop traced under the named scope `loop`
    (`jax.named_scope(loop)`: its op_name holds "/loop/")."""
    whiles = [rest for _, op, rest in instructions(bodies[entry]).values() if op == "while" and f"/{loop}/" in rest]
    if len(whiles) != 1:
        raise ValueError(f"expected one while loop named {loop!r} in the entry computation, found {len(whiles)}")
    condition, body = (re.search(rf"\b{key}=%?([\w.\-]+)", whiles[0]).group(1) for key in ("condition", "body"))
    return condition, body


def executions(bodies: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of ENTRY."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in bodies.items():
        table = instructions(lines)
        for line in lines:
            times = trip_count(line, table, bodies) if " while(" in line else 1
            calls[name] += [(callee, times) for callee in callees(line) if callee in bodies]
    runs: Counter = Counter()

    def visit(name: str, times: int, depth: int = 0):
        if depth > 64:  # HLO computations form a DAG; a deeper chain means a parse went wrong
            raise ValueError(f"HLO call chain through {name} deeper than 64")
        runs[name] += times
        for callee, factor in calls[name]:
            visit(callee, times * factor, depth + 1)

    visit(entry, 1)
    return runs


def loop_runs(hlo: str, loop: str | None = None) -> tuple[dict[str, list[str]], Counter]:
    """(computations of `hlo`, how many times each runs): per execution of the program; with `loop`, per iteration
    of the ENTRY computation's loop of that name (`named_loop`), its condition and body."""
    bodies, entry = computations(hlo)
    if loop is None:
        return bodies, executions(bodies, entry)
    runs: Counter = Counter()
    for root in named_loop(bodies, entry, loop):
        runs.update(executions(bodies, root))
    return bodies, runs


# A dot's contracting axes of its left operand: HLO's attribute, or XLA:GPU's library-call config (cuBLAS gemms).
_LHS_CONTRACTING = re.compile(r'lhs_contracting_dims=\{([0-9,]*)\}|"lhs_contracting_dimensions":\[([0-9",]*)\]')


def dot_flops(hlo: str) -> int:
    """2 x multiply-adds of every product in compiled `hlo` (`dot`s, in fusions too, and XLA:GPU's gemm library
    calls), times the runs of its computation: the products' flops per device, counted from the text, for
    executables that have no cost analysis (cross-compiled for compile-only GPUs). The left operand's type is read
    off its defining instruction."""
    bodies, entry = computations(hlo)
    runs = executions(bodies, entry)
    total = 0
    for name, lines in bodies.items():
        table = instructions(lines)
        for result, op, rest in table.values():
            contracting = _LHS_CONTRACTING.search(rest) if op in ("dot", "custom-call") else None
            if contracting is None:
                continue
            lhs = OPERAND.findall(rest.partition(")")[0])[0]
            shape = _ARRAY.search(table[lhs][0])
            dims = [int(d) for d in filter(None, shape.group(2).split(","))]
            depth = 1
            for axis in filter(None, (contracting.group(1) or contracting.group(2)).replace('"', "").split(",")):
                depth *= dims[int(axis)]
            outputs = 1
            for d in filter(None, _ARRAY.search(result).group(2).split(",")):
                outputs *= int(d)
            total += 2 * outputs * depth * runs[name]
    return total
