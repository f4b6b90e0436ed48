"""Compile `generate` for a device topology with abstract parameters and read what the program holds and moves.

Nothing runs on the topology: parameters are `jax.ShapeDtypeStruct`s in their shardings, and XLA compiles (for TPU
through libtpu) the same jitted programs `generate` runs. From them:
  - memory per device: parameters and caches (from their shardings), XLA's temporaries, the total against capacity;
  - the collectives of one decode round (its HLO, each counted as often as it runs);
  - HBM bytes of one plain step and one MTP round, read off one iteration of the decode loop of `generate`'s
    compiled HLO (`hlo_traffic`: in-place updates and slices count what they touch, loop bodies count per
    iteration; what the program prepares once before its loop is not a round's);
  - their flops: XLA's cost analysis of the round compiled by itself with its loops unrolled (a loop body is
    otherwise counted once); layers cost the same, so the round is compiled for the trunk cut to two repeats of each
    segment, and once more with one more repeat per segment, and the difference extrapolated to the full depth.

    plan = planning.plan(cfg, target, "data=1,model=8", Workload(batch=8, prompt_len=64, max_new_tokens=4096, k=3))
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.config.execution_plan import ExecutionPlan
from mtp_jax.config.model import ModelConfig
from mtp_jax.decode import speculative
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.models.causal_lm import CausalLM, hold_for_platform
from mtp_jax.ops import loops
from mtp_jax.parallel import sharding
from mtp_jax.plan import hlo_text
from mtp_jax.plan.hlo_collectives import collectives
from mtp_jax.plan.hlo_traffic import hbm_bytes
from mtp_jax.plan.routed_floor import expected_experts
from mtp_jax.plan.topology import Target
from mtp_jax.quant.formats import quantize_model

PARAM_SIZED = 0.01  # a collective moving more than this fraction of a device's parameter bytes is flagged
PROGRAMS_KEPT = 16  # compiled programs a process keeps for plans that compile them again (`compiled`)
_KEPT: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()  # key -> (compiled, compile seconds)


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int = 8
    prompt_len: int = 64
    max_new_tokens: int = 4096
    num_draft: int = 3
    tree: int = 0  # a draft tree's node budget (num_draft its depth); 0: chains
    tree_width: int = 4
    plan: ExecutionPlan | None = None  # None: the plan `generate` resolves for the model's mesh

    def decode_config(self, num_draft: int | None = None) -> DecodeConfig:
        """Rounds of k = num_draft drafts (default the workload's), drafted as a tree when the workload's is one
        (k > 0); k = 0: plain steps."""
        k = self.num_draft if num_draft is None else num_draft
        tree = self.tree if k else 0
        return DecodeConfig(
            num_draft=k, max_new_tokens=self.max_new_tokens, tree=tree, tree_width=self.tree_width, plan=self.plan
        )


@dataclasses.dataclass
class RoundCost:
    """One round's cost per device."""

    hbm_bytes: float
    flops: float
    ici_bytes: float


def abstract_model(
    cfg: ModelConfig, dtype, rules: sharding.ShardingRules, weights: str = "auto", layout: str = "auto"
) -> CausalLM:
    """The model with every parameter a `ShapeDtypeStruct` in its sharding (no memory), rules attached; its matmul
    weights stored as `weights` says (`quant.quantize_model`), held as decode holds them on the rules' devices
    (`causal_lm.hold_for_platform`: layers as `layout` says, float8 values as bits on a CPU)."""
    platform = sharding.mesh_platform(rules.mesh)
    build = lambda: hold_for_platform(quantize_model(CausalLM(cfg, dtype=dtype), weights), layout, platform)

    def spec(leaf, axes):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=rules.sharding(axes, leaf.shape))

    model = sharding.map_params(nnx.eval_shape(build), spec)
    model.sharding_rules = rules
    return model


def shard_bytes(leaves) -> int:
    """Bytes one device holds of these sharded arrays or `ShapeDtypeStruct`s (the largest shard of each)."""
    total = 0
    for leaf in jax.tree.leaves(leaves):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


def _inputs(model: CausalLM, work: Workload):
    rules = model.sharding_rules
    batch = rules.sharding(("batch", None))
    ids = jax.ShapeDtypeStruct((work.batch, work.prompt_len), jnp.int32, sharding=batch)
    lens = jax.ShapeDtypeStruct((work.batch,), jnp.int32, sharding=rules.sharding(("batch",)))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rules.sharding(()))
    sampling = jax.eval_shape(lambda: SamplingParams.from_config(work.decode_config(), work.batch))
    sampling = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rules.sharding(("batch",)[: a.ndim])), sampling
    )
    return ids, lens, key, sampling


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def _start(graphdef, params, ids, lens, key, sampling, cfg: DecodeConfig):
    model = nnx.merge(graphdef, params)
    with speculative.tracing(model, cfg):
        return speculative.start_state(model, ids, lens, key, sampling, cfg, greedy=True)


def _rounds(graphdef, cfg: DecodeConfig, unroll: bool, params, caches, state, sampling):
    """The decode loop as `generate` runs it from the prefill's state, under its mesh rules and execution plan: the
    weights prepared for the loop (`speculative.round_step`), then rounds until every row is done. A plan reads one
    round off the loop's body."""
    model = nnx.merge(graphdef, params)
    with speculative.tracing(model, cfg), loops.unrolled() if unroll else contextlib.nullcontext():
        state = state.replace(cache=caches[0], mtp_cache=caches[1])
        running = lambda s: ~jnp.all(s.done)
        body = speculative.round_step(model, cfg, sampling, True, running)
        with jax.named_scope(speculative.DECODE_LOOP):
            return jax.lax.while_loop(running, body, state)


def compiled(mesh: jax.sharding.Mesh, lowered):
    """`lowered.compile()` (a program over `mesh`), and the seconds that compile took. A process that plans several
    workloads (chains and trees, a plain step beside each round) lowers some programs more than once; the same
    program text for the same devices under the same compiler settings is compiled once, and the PROGRAMS_KEPT last
    ones are kept."""
    devices = (mesh.axis_names, mesh.devices.shape, tuple(mesh.devices.flat))
    settings = (jax.config.values["jax_disable_most_optimizations"], os.environ.get("XLA_FLAGS"),
                os.environ.get("LIBTPU_INIT_ARGS"))  # fmt: skip
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), devices, settings)
    if key in _KEPT:
        _KEPT.move_to_end(key)
        return _KEPT[key]
    start = time.perf_counter()
    kept = _KEPT[key] = (lowered.compile(), time.perf_counter() - start)
    if len(_KEPT) > PROGRAMS_KEPT:
        _KEPT.popitem(last=False)
    return kept


def compile_generate(model: CausalLM, work: Workload):
    """The whole program `generate` runs (greedy), compiled for the model's mesh."""
    return _timed_generate(model, work)[0]


def _timed_generate(model: CausalLM, work: Workload):
    """`compile_generate`'s program and the seconds its compile took (`compiled`)."""
    ids, lens, key, sampling = _inputs(model, work)
    lowered = speculative.lower_generate(model, ids, lens, key, sampling, work.decode_config(), greedy=True)
    return compiled(model.sharding_rules.mesh, lowered)


def start_state(model: CausalLM, work: Workload, num_draft: int, shardings=None):
    """The loop state after the prefill, as `ShapeDtypeStruct`s in the shardings the compiled prefill gives it (or
    in `shardings`, a tree of them from the same model at another depth: the layouts do not depend on it)."""
    graphdef, params = nnx.split(model)
    ids, lens, key, sampling = _inputs(model, work)
    cfg = work.decode_config(num_draft)
    if shardings is None:
        prefill = _start.lower(graphdef, params, ids, lens, key, sampling, cfg=cfg)
        shardings = compiled(model.sharding_rules.mesh, prefill)[0].output_shardings
    shapes = jax.eval_shape(functools.partial(_start, graphdef, cfg=cfg), params, ids, lens, key, sampling)
    return jax.tree.map(lambda s, shard: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shard), shapes, shardings)


def compile_round(model: CausalLM, work: Workload, num_draft: int, state=None, unroll: bool = False):
    """The decode loop of rounds by itself, compiled (see `lower_round`)."""
    return compiled(model.sharding_rules.mesh, lower_round(model, work, num_draft, state, unroll))[0]


def lower_round(model: CausalLM, work: Workload, num_draft: int, state=None, unroll: bool = False):
    """The decode loop (rounds of k = num_draft drafts; 0: plain steps) by itself, from the prefill's state, with
    the model's loops unrolled if `unroll` (a static argument, so a rolled compile is never reused for it),
    lowered. What a round moves is one iteration of its loop (`hlo_traffic.hbm_bytes(hlo, speculative.DECODE_LOOP)`);
    XLA's cost analysis counts the body once.
    As in `generate`, the loop reads the weights as prepared before it (`quant.prepare_for_loop`): work on the
    weights alone, made once there, is not a round's. Its caches are donated, so they are updated in place as in
    `generate`, and XLA picks their layout (the loop pins the one attention reads)."""
    graphdef, params = nnx.split(model)
    state = start_state(model, work, num_draft) if state is None else state
    sampling = _inputs(model, work)[3]
    caches, rest = (state.cache, state.mtp_cache), state.replace(cache=None, mtp_cache=None)
    shardings = lambda tree: jax.tree.map(lambda leaf: leaf.sharding, tree)
    auto = jax.tree.map(lambda leaf: Format(Layout.AUTO, leaf.sharding), caches)
    out = shardings(rest).replace(cache=auto[0], mtp_cache=auto[1])  # the state out, caches in XLA's layout too
    program = jax.jit(
        _rounds,
        static_argnums=(0, 1, 2),
        donate_argnums=(4,),
        in_shardings=(shardings(params), auto, shardings(rest), shardings(sampling)),
        out_shardings=out,
    )
    return program.lower(graphdef, work.decode_config(num_draft), unroll, params, caches, rest, sampling)


def with_segment_repeats(cfg: ModelConfig, repeats: tuple[int, ...]) -> ModelConfig:
    """`cfg` with segment i of its trunk repeated repeats[i] times (same kinds, same order)."""
    kinds = [
        kind for segment, n in zip(cfg.segments(), repeats, strict=True) for _ in range(n) for kind in segment.kinds
    ]
    changes: dict = {"num_layers": len(kinds)}
    if cfg.layer_types:
        changes["layer_types"] = tuple(
            "linear_attention" if k.attention == "deltanet" else "full_attention" for k in kinds
        )
    if cfg.moe is not None:
        dense = sum(1 for k in kinds if k.mlp == "dense")
        changes["moe"] = dataclasses.replace(cfg.moe, first_dense_layers=dense)
    cut = cfg.replace(**changes)
    if tuple(s.count for s in cut.segments()) != tuple(repeats) or [s.kinds for s in cut.segments()] != [
        s.kinds for s in cfg.segments()
    ]:
        raise ValueError(f"cannot cut {cfg.family} to segment repeats {repeats}")
    return cut


def _flops_of(model: CausalLM, lowered) -> float:
    """XLA's flop count of the compiled program; where a cross-compiled executable has none (compile-only GPUs), its
    products' flops counted off its HLO (`hlo_text.dot_flops`): a lower bound, since XLA:GPU computes a one-row
    product as a reduction, not a dot (measured on an H100:
    docs/benchmarks-log.md#deepseek-v3-in-fp8-on-a-node-of-8-gpus-compiled-by-xlagpu---topology-gpu8-one-h100)."""
    program = compiled(model.sharding_rules.mesh, lowered)[0]
    analysis = program.cost_analysis()
    if not analysis:
        return float(hlo_text.dot_flops(program.as_text()))
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis.get("flops", 0.0))


def round_cost(
    cfg: ModelConfig,
    dtype,
    rules,
    work: Workload,
    num_draft: int,
    state,
    hlo: str,
    weights: str = "auto",
    layout: str = "auto",
) -> RoundCost:
    """HBM bytes, flops and interconnect bytes per device of one round at the full depth: bytes and interconnect
    bytes read off one iteration of the decode loop of `hlo` (`round_program`; loops rolled, bodies counted per
    execution: `hlo_traffic`, `hlo_collectives`); flops from XLA's cost analysis of the round with its loops
    unrolled, for the trunk cut to two repeats of each segment and to one more, extrapolated to the full depth (see
    the module doc).
    `state`: the full-depth model's loop state at k = num_draft, whose layouts the cut trunks' states take."""
    full = tuple(s.count for s in cfg.segments())
    base = tuple(min(n, 2) for n in full)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, state)

    def flops(repeats):
        model = abstract_model(with_segment_repeats(cfg, repeats), dtype, rules, weights, layout)
        return _flops_of(
            model, lower_round(model, work, num_draft, start_state(model, work, num_draft, shardings), True)
        )

    at_base = flops(base)
    total = at_base
    for i, (n, b) in enumerate(zip(full, base, strict=True)):
        if n > b:  # one more repeat of segment i: what each of its layers adds
            total += (n - b) * (flops(tuple(r + (j == i) for j, r in enumerate(base))) - at_base)
    moved = sum(c.moved_bytes for c in collectives(hlo, speculative.DECODE_LOOP))
    traffic = hbm_bytes(hlo, speculative.DECODE_LOOP, routed_reads(cfg))
    return RoundCost(hbm_bytes=float(traffic), flops=total, ici_bytes=float(moved))


def routed_reads(cfg: ModelConfig):
    """The experts the routed-experts kernel fetches per call under uniform routing (the used ones:
    `routed_floor.expected_experts`, at most its slots), for `hlo_traffic`; None for a dense model."""
    moe = cfg.moe
    if moe is None:
        return None
    return lambda rows, local, slots: min(slots, expected_experts(rows, moe.experts_per_token, moe.num_experts, local))


def plain_step_floor(model: CausalLM, state) -> int:
    """Bytes per device a plain step cannot avoid reading: the trunk's weights, the final norm and the lm_head (the
    embedding table too when the head is tied to it; otherwise only B of its rows are gathered), and the whole trunk
    cache (a step late in a generation that fills it). Not the MTP layer, which a plain step does not run."""
    params = nnx.to_pure_dict(nnx.split(model)[1])
    read = {key: value for key, value in params.items() if key not in ("mtp", "draft_vocab")}
    if model.lm_head is not None:
        read.pop("embed")
    return shard_bytes(read) + shard_bytes(state.cache)


def projected_ms(cost: RoundCost, target: Target) -> float:
    """max(HBM bytes / bandwidth, flops / peak) + interconnect bytes / ICI bandwidth, per device, in ms."""
    share = target.devices_per_chip
    chip = target.chip
    memory = cost.hbm_bytes / (chip.hbm_gbps * 1e9 / share)
    compute = cost.flops / (chip.bf16_tflops * 1e12 / share)
    return 1000 * (max(memory, compute) + cost.ici_bytes / (chip.ici_gbps * 1e9))


def tokens_per_round(acceptance: list[float], num_draft: int) -> float:
    """Expected tokens a round emits: 1 + a1 + a1 a2 + ... (conditional acceptance per position; the last value
    repeats for deeper positions)."""
    expected, reach = 1.0, 1.0
    for i in range(num_draft):
        reach *= acceptance[min(i, len(acceptance) - 1)]
        expected += reach
    return expected


def is_out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "exceeds available HBM" in str(error)


def memory_report(model: CausalLM, work: Workload, target: Target, state) -> dict:
    """Per-device bytes of parameters, caches (of `state`, the loop state at k = work.num_draft), other temporaries
    and the whole program, or `fits: false` with the compiler's reason when it refuses the program; compile time."""
    params = shard_bytes(nnx.split(model)[1])
    caches = shard_bytes([state.cache, state.mtp_cache])
    report = {"params": params, "caches": caches, "capacity": target.capacity_bytes}
    start = time.perf_counter()
    try:
        program, seconds = _timed_generate(model, work)
    except Exception as e:  # the compiler's own refusal of a program that does not fit
        if not is_out_of_memory(e):
            raise
        first = next((line for line in str(e).splitlines() if "RESOURCE_EXHAUSTED" in line), str(e).splitlines()[0])
        return {**report, "temporaries": None, "total": None, "fits": False, "reason": first.strip()[:300],
                "compile_seconds": time.perf_counter() - start}  # fmt: skip
    stats = program.memory_analysis()
    held = (
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )
    report |= {"temporaries": max(stats.temp_size_in_bytes - caches, 0), "total": int(held)}
    return {**report, "fits": held <= target.capacity_bytes, "compile_seconds": seconds, "program": program}


def round_program(model: CausalLM, work: Workload, num_draft: int, state, program=None) -> str:
    """HLO text of a program whose decode loop runs rounds of k = num_draft drafts as decoding runs them:
    `program` (`generate`'s, compiled for `work` at that k), or `generate` compiled now (`compile_generate`);
    where the compiler refuses `generate` for memory, the loop by itself from `state` (`compile_round`). A round
    is read off its loop (`hlo_traffic.hbm_bytes(hlo, speculative.DECODE_LOOP)`)."""
    if program is None:
        try:
            program = compile_generate(model, dataclasses.replace(work, num_draft=num_draft))
        except Exception as e:  # the compiler's own refusal of a program that does not fit
            if not is_out_of_memory(e):
                raise
            program = compile_round(model, work, num_draft, state)
    return program.as_text()
