"""python -m mtp_jax.plan: compile the decode loop for a device topology and project it (nothing runs there).

    python -m mtp_jax.plan --random-shape deepseek-v3 --topology v5p:4x4x4 --mesh data=1,model=4,expert=16
    python -m mtp_jax.plan --model path/to/config.json --topology v5e:2x4 --mesh auto --json plans.json

Per device: parameter, cache and temporary bytes against its memory (fits or not), the collectives of one decode
round, HBM bytes and flops of a plain step and of an MTP round, and projected tokens/s from the chip's public figures
(mtp_jax/plan/topology.py). Every number is the compiled program's, for the topology, projected: not measured on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cli.arguments import add_tree_arguments, check_output_path, positive_int
from mtp_jax.config.model import LAYER_LAYOUTS
from mtp_jax.decode import speculative
from mtp_jax.families.registry import family_of
from mtp_jax.kernels import traced_plan
from mtp_jax.loading.hub import local_path
from mtp_jax.models.causal_lm import preferred_layout
from mtp_jax.parallel import sharding
from mtp_jax.plan import planning, routed_floor, shapes, topology
from mtp_jax.plan.hlo_collectives import collectives
from mtp_jax.plan.planning import PARAM_SIZED
from mtp_jax.quant.formats import STORED_FORMATS, WEIGHT_FORMATS
from mtp_jax.runtime.errors import OneLineParser, UserError, run_cli
from mtp_jax.runtime.files import write_atomically

ASSUMED_ACCEPTANCE = (0.8, "assumed: no published per-position figure for this family")

PLANNED_OPERATIONS = ("products", "attention", "small_experts", "large_experts", "delta_rule")  # in the markdown


def float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected acceptance rates in [0, 1], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m mtp_jax.plan", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        help="a checkpoint folder or Hugging Face repo id ORG/NAME[@REVISION], or a folder or file holding only its "
        "config.json",
    )
    source.add_argument("--random-shape", help="a named shape (mtp_jax/plan/shapes.py), e.g. deepseek-v3, qwen3.6-27b")
    parser.add_argument(
        "--topology", required=True, help="v5e:2x4, v5p:4x4x4, v6e:4x4, v4:2x2x2, gpu:N (GPUs like the one here), cpu:N"
    )
    parser.add_argument("--mesh", default="auto", help="data=D,model=M[,expert=E], or auto: every legal mesh, ranked")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--max-new-tokens", type=positive_int, default=4096)
    parser.add_argument("--num-draft", type=int, default=3, choices=range(0, 9), metavar="K")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto")
    parser.add_argument("--layer-layout", choices=LAYER_LAYOUTS, default="auto",
                        help="layers as decode holds them on the target (auto: stacked on TPU, unstacked on GPU), "
                        "or stacked / unstacked")  # fmt: skip
    parser.add_argument("--acceptance", type=float_list, help="per-position acceptance A1,A2,... (default: family's)")
    add_tree_arguments(parser)
    parser.add_argument("--tokens-per-round", type=float, metavar="T", help="a measured mean accepted length (tokens "
                        "per verify round, e.g. decode's stats) to project with, in place of the per-position "
                        "acceptance's chain estimate (which stands in for a tree's)")  # fmt: skip
    parser.add_argument(
        "--draft-vocab",
        type=positive_int,
        metavar="N",
        help="plan the MTP head as drafting from N token ids (a head trained by `train_head --draft-vocab N`; "
        "default: the model's)",
    )
    parser.add_argument("--capacity-gib", type=float, help="memory per device (default: the chip's HBM)")
    parser.add_argument("--json", help="write the plan(s) as JSON here")
    parser.add_argument("--markdown", help="write the plan table as markdown here")
    parser.add_argument(
        "--dump-hlo",
        help="folder for plain_step.hlo.txt and mtp_round.hlo.txt: the compiled programs whose decode loop (scope "
        "decode_loop) the plain step and the MTP round are read off (first mesh)",
    )
    return parser


def model_config(args):
    if args.random_shape:
        config, name = shapes.shape(args.random_shape), args.random_shape
    else:
        config = shapes.config_from_path(local_path(args.model, files=["config.json"]))  # a repo id: its config only
        name = os.path.basename(os.path.normpath(args.model))
    if args.draft_vocab is None:
        return config, name
    if not config.has_mtp:
        raise UserError(f"--draft-vocab: {name} has no MTP head to draft with")
    if args.draft_vocab > config.vocab_size:
        raise UserError(f"--draft-vocab {args.draft_vocab} is more than {name}'s {config.vocab_size} tokens")
    return config.replace(mtp=dataclasses.replace(config.mtp, draft_vocab_size=args.draft_vocab)), name


def candidate_meshes(spec: str, target, cfg, batch: int) -> list[str]:
    """The mesh specs to plan: the one given, or (auto) every data x expert x model split of the devices with the
    batch divisible over data and an expert axis only for models with experts, that the torus can lay out."""
    count = len(target.devices)
    if spec != "auto":
        try:
            sizes = sharding.parse_mesh_spec(spec, count)
            sharding.make_mesh(spec, target.devices)
        except ValueError as e:
            raise UserError(f"{e}; meshes that lay out here: {'; '.join(legal_sizes(target))}") from e
        return [",".join(f"{a}={n}" for a, n in sizes.items())]
    specs = []
    for data in divisors(count):
        for expert in divisors(count // data) if cfg.moe is not None else [1]:
            spec = f"data={data},expert={expert},model={count // data // expert}"
            if batch % data == 0 and _lays_out(spec, target):
                specs.append(spec)
    return specs


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _lays_out(spec: str, target) -> bool:
    try:
        sharding.make_mesh(spec, target.devices)
    except ValueError:
        return False
    return True


def legal_sizes(target) -> list[str]:
    """The (data, expert, model) sizes over all the target's devices that its torus lays out."""
    count = len(target.devices)
    found = []
    for data in divisors(count):
        for expert in divisors(count // data):
            spec = f"data={data},expert={expert},model={count // data // expert}"
            if _lays_out(spec, target):
                found.append(spec)
    return found


def memory_line(memory: dict) -> str:
    """One line of a plan's memory report, GiB per device."""
    if memory["total"] is None:
        return f"memory per device: params {gib(memory['params'])} GiB; does not fit ({memory['reason']})"
    return (
        f"memory per device: params {gib(memory['params'])}, caches {gib(memory['caches'])}, other temporaries "
        f"{gib(memory['temporaries'])}, total {gib(memory['total'])} / {gib(memory['capacity'])} GiB: "
        f"{'fits' if memory['fits'] else 'does not fit'} (compiled in {memory['compile_seconds']:.0f} s)"
    )


def plan_mesh(args, cfg, name: str, target, spec: str, work, dump_hlo: str | None) -> dict:
    """One mesh's plan (see the module doc)."""
    rules = sharding.ShardingRules(sharding.make_mesh(spec, target.devices))
    dtype = jnp.dtype(args.dtype)
    platform = sharding.mesh_platform(rules.mesh)
    layout = args.layer_layout
    if layout == "auto":
        layout = preferred_layout(platform, quantized=args.weights in STORED_FORMATS)
    model = planning.abstract_model(cfg, dtype, rules, args.weights, layout)
    k = work.num_draft if cfg.has_mtp else 0
    work = dataclasses.replace(work, num_draft=k)
    state = planning.start_state(model, work, k)
    memory = planning.memory_report(model, work, target, state)
    program = memory.pop("program", None)  # generate's, for rounds of k
    print(memory_line(memory), file=sys.stderr)  # the answer to "does it fit" before minutes of cost compiles
    hlo = planning.round_program(model, work, k, state, program)
    found = collectives(hlo, speculative.DECODE_LOOP)
    plain_state = planning.start_state(model, work, 0) if k else state
    plain_hlo = planning.round_program(model, work, 0, plain_state) if k else hlo
    if dump_hlo:
        write_hlo(dump_hlo, "plain_step", plain_hlo)
        if k:
            write_hlo(dump_hlo, "mtp_round", hlo)
    costs = {
        "plain_step": planning.round_cost(cfg, dtype, rules, work, 0, plain_state, plain_hlo, args.weights, layout)
    }
    if k:
        costs["mtp_round"] = planning.round_cost(cfg, dtype, rules, work, k, state, hlo, args.weights, layout)
    steps = {key: {**vars(cost), "projected_ms": planning.projected_ms(cost, target)} for key, cost in costs.items()}
    floor = planning.plain_step_floor(model, plain_state)
    steps["plain_step"] |= {"floor_bytes": floor, "hbm_over_floor": steps["plain_step"]["hbm_bytes"] / floor}
    for key, step_state, drafts in (("plain_step", plain_state, 0), ("mtp_round", state, k)):
        if key in steps:
            cache = planning.shard_bytes(step_state.cache) + (
                planning.shard_bytes(step_state.mtp_cache) if drafts else 0
            )
            tree = work.tree if drafts else 0
            routed = routed_floor.routed_floor_bytes(model, cache, work.batch, drafts, tree, work.tree_width)
            steps[key] |= {"routed_floor_bytes": routed, "hbm_over_routed_floor": steps[key]["hbm_bytes"] / routed}
    if k:
        steps["mtp_round"]["over_plain_step"] = steps["mtp_round"]["projected_ms"] / steps["plain_step"]["projected_ms"]
    acceptance, source = acceptance_for(args, cfg)
    per_round = planning.tokens_per_round(acceptance, k)
    if args.tokens_per_round is not None and k:
        per_round, source = args.tokens_per_round, "--tokens-per-round"
    plain_ms = steps["plain_step"]["projected_ms"]
    return {
        "topology": target.name,
        "chip": target.chip.name,
        "num_chips": target.num_chips,
        "num_devices": len(target.devices),
        "mesh": dict(rules.mesh.shape),
        "model": name,
        "params": sum(x.size for x in jax_leaves(model)),
        "batch_size": work.batch,
        "prompt_len": work.prompt_len,
        "max_new_tokens": work.max_new_tokens,
        "num_draft": k,
        "tree": work.tree if k else 0,
        "tree_width": work.tree_width,
        "draft_vocab": cfg.mtp.draft_vocab_size if cfg.has_mtp else 0,
        "weights": args.dtype if args.weights == "auto" else args.weights,
        "layer_layout": layout,
        "execution_plan": (work.plan or traced_plan.resolve(rules)).as_dict(),
        "compile_seconds": round(memory.pop("compile_seconds"), 1),
        "fits": memory.pop("fits"),
        "reason": memory.pop("reason", None),
        "per_chip_bytes": memory,
        "round_collectives": [collective_row(c, memory["params"]) for c in found],
        **steps,
        "acceptance": acceptance,
        "acceptance_source": source,
        "tokens_per_round": per_round,
        "projected_tokens_per_second": {
            "plain": 1000 * work.batch / plain_ms,
            "mtp": 1000 * work.batch * per_round / steps["mtp_round"]["projected_ms"] if k else None,
        },
        "note": "compiled for the topology with abstract weights and projected from public chip figures; not run",
    }


def collective_row(c, params_bytes: int) -> dict:
    """A collective as the plan lists it; `param_sized` when one execution moves more than PARAM_SIZED of the
    device's parameter bytes (a round should move activations, never weights)."""
    moved = max(c.operand_bytes, c.result_bytes)
    return {"kind": c.kind, "shape": c.shape, "operand_bytes": c.operand_bytes, "result_bytes": c.result_bytes,
            "count": c.count, "param_sized": moved > PARAM_SIZED * params_bytes}  # fmt: skip


def write_hlo(folder: str, name: str, hlo: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.hlo.txt"), "w") as f:
        f.write(hlo)


def jax_leaves(model):
    return jax.tree.leaves(nnx.split(model)[1])


def acceptance_for(args, cfg) -> tuple[list[float], str]:
    if args.acceptance:
        return args.acceptance, "given (--acceptance)"
    rate, source = family_of(cfg.family).published_acceptance or ASSUMED_ACCEPTANCE
    return [rate], source


def gib(n) -> str:
    return "-" if n is None else f"{n / 1024**3:.2f}"


def number(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(plans: list[dict]) -> str:
    lines = [
        "| model | topology | mesh | params GiB/chip | cache GiB/chip | other temp GiB/chip | total / capacity GiB "
        "| fits | collectives per round (largest) | plain ms | MTP ms | plain tok/s | MTP tok/s | HBM / floor "
        "| plain / routed floor | MTP / routed floor | MTP round / plain step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        mem, tps = p["per_chip_bytes"], p["projected_tokens_per_second"]
        mesh = ",".join(f"{a}={n}" for a, n in p["mesh"].items())
        rounds = p["round_collectives"]
        largest = f" ({rounds[0]['kind']} {rounds[0]['shape']} x{rounds[0]['count']})" if rounds else ""
        cells = [
            p["model"], p["topology"], mesh, gib(mem["params"]), gib(mem["caches"]), gib(mem["temporaries"]),
            f"{gib(mem['total'])} / {gib(mem['capacity'])}", "yes" if p["fits"] else "no",
            f"{sum(c['count'] for c in rounds)}{largest}", number(p["plain_step"]["projected_ms"], 2),
            number(p.get("mtp_round", {}).get("projected_ms"), 2), number(tps["plain"]), number(tps["mtp"]),
            number(p["plain_step"]["hbm_over_floor"], 2), number(p["plain_step"]["hbm_over_routed_floor"], 2),
            number(p.get("mtp_round", {}).get("hbm_over_routed_floor"), 2),
            number(p.get("mtp_round", {}).get("over_plain_step"), 2),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for p in plans:
        plan = p["execution_plan"]
        chosen = ", ".join(f"{name} {plan[name]}" for name in PLANNED_OPERATIONS)
        lines.append(f"- {p['model']} on {p['topology']}: execution plan {chosen}")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    if args.capacity_gib is not None and args.capacity_gib <= 0:
        raise UserError("--capacity-gib must be positive")
    for path, option in ((args.json, "--json"), (args.markdown, "--markdown")):
        if path:
            check_output_path(path, option)  # before minutes of compiling
    cfg, name = model_config(args)
    target = topology.resolve(args.topology, args.capacity_gib)
    work = planning.Workload(args.batch_size, args.prompt_len, args.max_new_tokens, args.num_draft, args.tree,
                             args.tree_width)  # fmt: skip
    try:
        work.decode_config()
    except ValueError as e:
        raise UserError(str(e)) from None
    if cfg.max_position_embeddings < work.prompt_len + work.max_new_tokens:
        raise UserError(
            f"prompt {work.prompt_len} + budget {work.max_new_tokens} passes the model's context "
            f"({cfg.max_position_embeddings} positions)"
        )
    specs = candidate_meshes(args.mesh, target, cfg, work.batch)
    if not specs:
        raise UserError(f"no mesh over {len(target.devices)} devices splits a batch of {work.batch} rows")
    plans = []
    for i, spec in enumerate(specs):
        print(f"planning {name} on {target.name}, mesh {spec} ({i + 1}/{len(specs)})", file=sys.stderr)
        try:
            plans.append(plan_mesh(args, cfg, name, target, spec, work, args.dump_hlo if i == 0 else None))
        except Exception as e:  # the compiler refused one of its programs for the chip's memory
            if not planning.is_out_of_memory(e):
                raise
            print(f"mesh {spec}: does not fit: {out_of_memory_reason(e)}", file=sys.stderr)
    if not plans:
        raise UserError(f"{name} does not fit {target.name} on any mesh tried ({', '.join(specs)})")
    plans.sort(key=lambda p: (not p["fits"], -(p["projected_tokens_per_second"]["mtp"] or
                                                p["projected_tokens_per_second"]["plain"])))  # fmt: skip
    table = markdown(plans)
    print(table, end="")
    if args.json:
        write_atomically(args.json, json.dumps(plans if args.mesh == "auto" else plans[0], indent=2))
    if args.markdown:
        write_atomically(args.markdown, table)
    return 0


def out_of_memory_reason(error: Exception) -> str:
    """The compiler's line saying what did not fit."""
    lines = str(error).splitlines() or [type(error).__name__]
    return next((line for line in lines if "RESOURCE_EXHAUSTED" in line), lines[0]).strip()[:300]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Before JAX starts a backend: plans compile only, so JAX itself stays on the host (no TPU runtime is claimed)
    # unless gpu:N needs the attached GPU's description; cpu:N asks for N host devices; libtpu's compiler may be
    # loaded by several processes at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if "JAX_PLATFORMS" not in os.environ and not args.topology.startswith("gpu:"):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_disable_most_optimizations", False)  # plan the program as it runs (tests turn them off)

    topology.request_host_devices(args.topology)
    return run_cli(run, args)
