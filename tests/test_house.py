"""The shape of the code, checked on its source: imports run one way (no cycle among the modules of mtp_jax and
checkpoints_convert, and mtp_jax never imports checkpoints_convert), at the top of each file except for the heavy
optional ones, no module takes another's private names, no function is longer than 80 lines, and every family module
is registered."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

from mtp_jax.families.registry import FAMILIES

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("mtp_jax", "checkpoints_convert")
# Imported inside a function only: heavy to import, and needed by one path (a tokenizer, a peer, libtpu, the hub).
LAZY_IMPORTS = (
    "transformers",
    "torch",
    "jax.experimental.topologies",
    "llama_cpp",
    "huggingface_hub.snapshot_download",
    "orbax.checkpoint",
)
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = ast.parse(path.read_text(), str(path))
    return found


MODULES = modules()


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The project modules an import statement loads (a name imported from a package may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def dotted(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Every dotted name an import statement names (`from a.b import c`: a.b.c)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [f"{node.module}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules its top-level imports load, with the packages whose __init__ they run."""
    graph = {}
    for name, tree in MODULES.items():
        targets = set()
        for node in tree.body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in imported(node):
                    parts = target.split(".")
                    targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[name] = {t for t in targets if t in MODULES and t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def functions(tree: ast.Module):
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_imports_have_no_cycle_and_run_one_way():
    graph = import_graph()
    assert find_cycle(graph) is None, find_cycle(graph)
    upward = [
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if m.startswith("mtp_jax") and t.startswith("checkpoints_convert")
    ]
    assert not upward, upward


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_sit_at_the_top_of_their_files():
    inside = [
        (name, fn.name, ast.unparse(node))
        for name, tree in MODULES.items()
        for fn in functions(tree)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
        and not any(t == lazy or t.startswith(lazy + ".") for t in dotted(node) for lazy in LAZY_IMPORTS)
    ]
    assert not inside, inside


def test_no_module_takes_another_modules_private_names():
    private = [
        (name, node.module, alias.name)
        for name, tree in MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGES)
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not private, private


def test_no_function_is_longer_than_80_lines():
    long = [
        (name, fn.name, fn.end_lineno - fn.lineno + 1)
        for name, tree in MODULES.items()
        for fn in functions(tree)
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


FAMILY_MODULES = sorted(
    p.stem for p in (ROOT / "mtp_jax" / "families").glob("*.py") if "FAMILY = register(" in p.read_text()
)


@pytest.mark.parametrize("name", FAMILY_MODULES)
def test_every_family_module_is_registered(name):
    """A module of mtp_jax/families/ that builds a Family has it in the registry (adding a family = its module and
    its name on the registry's import line)."""
    assert importlib.import_module(f"mtp_jax.families.{name}").FAMILY in FAMILIES


def test_the_families_are_the_seven_modules():
    assert FAMILY_MODULES == ["deepseek_v3", "glm4_moe", "llama", "mimo", "qwen2", "qwen3", "qwen_hybrid"]
