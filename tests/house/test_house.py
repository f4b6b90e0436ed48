"""The shape of the code, checked on its source: the sub-packages of mtp_jax in one order, each importing only those
before it (and no cycle among the modules of mtp_jax and checkpoints_convert, which mtp_jax never imports); imports at
the top of each file except for the heavy optional ones; no module takes another's private names; no function longer
than 80 lines, no module longer than 400 outside the models' blocks and the kernels; at most 8 modules at the top
of mtp_jax (the API and the commands' shims); every family module registered."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

from mtp_jax.families.registry import FAMILIES

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("mtp_jax", "checkpoints_convert")
# Imported inside a function only: heavy to import, and needed by one path (a tokenizer, a peer, libtpu, the hub).
LAZY_IMPORTS = (
    "transformers",
    "torch",
    "jax.experimental.topologies",
    "llama_cpp",
    "huggingface_hub.snapshot_download",
    "orbax.checkpoint",
    "openai",  # the load test's client (bench --serve)
)
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400
LONG_MODULES_ALLOWED = ("mtp_jax.models.", "mtp_jax.kernels.")  # the models' blocks and the kernels
MAX_TOP_LEVEL_MODULES = 8
# The sub-packages, lowest first: each imports only those before it (its own modules aside). A command's shim (the
# top-level modules, a package's __main__) and the package's __init__ (the public API) may import anything.
PACKAGE_ORDER = (
    "runtime",  # errors, files, platforms, the cache folder, JAX's compilation cache
    "config",  # the model's shape, the decode settings and the execution plan
    "parallel",  # meshes, logical-axis rules, placement
    "quant",  # quantized weights, one module per format
    "ops",  # XLA's forms of the products and sums the models call
    "kernels",  # the execution plan resolved, the dispatch by it, and its implementations: CPU (native), Pallas
    "models",  # blocks, trunks, MTP head, KV caches
    "params",  # checkpoint sources and converted folders
    "families",  # each family's config and key table
    "conversion",  # checkpoint -> parameters, and back
    "loading",  # load_model, heads, the hub, the default model, tokenizers
    "decode",  # the loop: generate, rounds, sampling, text in and out
    "training",  # MTP head training and its evaluation
    "rl",  # rollout engines for JAX RL libraries (tunix), an optional extra
    "plan",  # compiling for a topology and reading the program
    "serve",  # the OpenAI-compatible HTTP server over the decode engine
    "bench",  # the peers the benchmark times
    "cli",  # every command: arguments and output
)


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


def package_of(module: str) -> str | None:
    """The sub-package of mtp_jax a module lies in (None: a top-level module, the package itself, a shim)."""
    parts = module.split(".")
    if parts[0] != "mtp_jax" or len(parts) < 3 or parts[-1] == "__main__":
        return None
    return parts[1]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported) pairs where a sub-package imports one after it in PACKAGE_ORDER."""
    rank = {name: i for i, name in enumerate(PACKAGE_ORDER)}
    return [
        (m, t)
        for m, targets in graph.items()
        if package_of(m) is not None
        for t in targets
        if t.startswith("mtp_jax.") and rank.get(t.split(".")[1], -1) > rank[package_of(m)]
    ]


def test_sub_packages_import_only_those_before_them():
    subpackages = sorted(p.name for p in (ROOT / "mtp_jax").iterdir() if (p / "__init__.py").exists())
    assert set(PACKAGE_ORDER) <= set(subpackages), set(PACKAGE_ORDER) - set(subpackages)
    assert set(subpackages) - set(PACKAGE_ORDER) <= {"data", "shipped_heads"}  # files only, no code
    assert not upward_imports(import_graph()), upward_imports(import_graph())


def test_the_order_check_finds_an_upward_import():
    graph = {
        "mtp_jax.models.moe": {"mtp_jax.decode.rounds", "mtp_jax.ops.rowwise"},
        "mtp_jax.decode.__main__": {"mtp_jax.cli.decode"},  # a shim may import its command
    }
    assert upward_imports(graph) == [("mtp_jax.models.moe", "mtp_jax.decode.rounds")]


def test_modules_stay_short_and_the_top_level_small():
    lengths = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): len(path.read_text().splitlines())
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    allowed = lambda name: name.startswith(LONG_MODULES_ALLOWED)
    long = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES and not allowed(name)}
    assert not long, long
    top = sorted(p.name for p in (ROOT / "mtp_jax").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


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


def test_the_families_are_the_eight_modules():
    assert FAMILY_MODULES == ["deepseek_v3", "glm4_moe", "llama", "mimo", "qwen2", "qwen3", "qwen3_moe", "qwen_hybrid"]


# Where a context variable may live, and what it carries: none of them chooses an implementation.
CONTEXT_VARIABLES = {
    "mtp_jax.kernels.traced_plan": "the execution plan of the program traced now, chosen before the trace",
    "mtp_jax.parallel.sharding": "the mesh rules of the program traced now",
    "mtp_jax.ops.loops": "loops unrolled for the planner's cost analysis",
}


def context_variables() -> set[str]:
    """The modules that create a contextvars.ContextVar."""
    calls = lambda tree: (n for n in ast.walk(tree) if isinstance(n, ast.Call))
    named = lambda call: ast.unparse(call.func).split(".")[-1] == "ContextVar"
    return {name for name, tree in MODULES.items() if any(named(call) for call in calls(tree))}


def import_time_calls(tree: ast.Module) -> list[str]:
    """Calls a module makes at its top level (outside assignments): a registration run by importing it (a custom
    derivative's `defvjp` aside: it completes a function's definition)."""
    calls = [node.value for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    return [ast.unparse(c) for c in calls if ast.unparse(c.func).split(".")[-1] not in ("defvjp", "defjvp")]


def test_no_registry_or_context_variable_chooses_an_implementation():
    """Each operation's implementation is the execution plan's member, picked in kernels/dispatch.py: no kernel or
    op module registers itself when imported, and the context variables are only the three that carry a trace's
    settings."""
    registering = {
        name: import_time_calls(tree)
        for name, tree in MODULES.items()
        if name.startswith(("mtp_jax.kernels", "mtp_jax.ops")) and import_time_calls(tree)
    }
    assert not registering, registering
    assert context_variables() == set(CONTEXT_VARIABLES), context_variables()


def test_the_registry_check_finds_an_import_time_registration():
    tree = ast.parse("import x\nx.register_kernel('k', lambda platform: True)\nf.defvjp(a, b)\nTABLE = {}\n")
    assert import_time_calls(tree) == ["x.register_kernel('k', lambda platform: True)"]
