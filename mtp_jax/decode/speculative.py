"""`generate`: MTP self-speculative decoding as one jitted `lax.while_loop` over fixed shapes.

The loop starts from the prefill's state (prefill.py) and runs rounds (rounds.py: draft -> verify -> commit -> record)
until every row is done. With a fixed k = num_draft every round drafts k tokens; k = 0 is plain decoding through the
same code.

Adaptive decoding (cfg.adaptive) compiles a round for every j = 0..k, a draft tree's round where cfg.tree names one, and
a rest, and moves between them on device (adaptive.py picks; `_adaptive_body`). A round with j = 0 (a probe) still runs
the MTP layer, to score a draft; a rest is a plain step that skips the MTP layer and appends its hidden and token to the
MTP block, which for adaptive decoding has REST_ROUNDS spare slots; the next round with MTP catches the MTP cache up
over all of them. Long rests slide the block instead (mtp_jax.decode.adaptive.RestSchedule): the MTP cache then skips
the dropped positions, and the block's `visible_from` hides everything before it from the MTP layer's attention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode import executable_cache
from mtp_jax.decode.adaptive import choose_round, drafting_can_pay, estimated_round_costs, step_param_bytes
from mtp_jax.decode.loop_state import DecodeStats, LoopState
from mtp_jax.decode.prefill import prefill
from mtp_jax.decode.rounds import Round, RoundKind, round_context, run_round
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.tree import check_tree_model, run_tree_round
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.dispatch import lone_rows_exact
from mtp_jax.models.cache_attention import two_rows
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.kv_cache import cache_slots, long_cache_shards
from mtp_jax.parallel.sharding import activate, constrain
from mtp_jax.quant.int8_activations import has_int8_activations
from mtp_jax.quant.loop_weights import prepare_for_loop

DECODE_LOOP = "decode_loop"  # the named scope of generate's loop of rounds (plans read a round off it: hlo_text)


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # [B, max_new_tokens] generated ids; 0 past each row's length
    lengths: jax.Array  # [B] number of generated tokens
    finished_by_eos: jax.Array  # [B] bool
    stats: DecodeStats

    def first_of_twins(self) -> GenerateOutput:
        """The output of row 0 of two identical rows (same prompt, same random stream): as if decoded alone."""
        per_row = ("row_rounds", "emitted", "drafted", "accepted", "reached", "accepted_at")
        stats = self.stats.replace(**{name: getattr(self.stats, name) // 2 for name in per_row})
        return GenerateOutput(self.tokens[:1], self.lengths[:1], self.finished_by_eos[:1], stats)


def _round_body(model, cfg: DecodeConfig, sampling, eos, keep_going):
    """The while-loop body: a round with cfg.num_draft drafts, a draft tree's round (cfg.tree), or, adaptive, the
    rounds the policy picks while `keep_going` (state -> bool) holds. Where the round costs say no draft can pay,
    adaptive decoding is plain decoding."""
    if cfg.adaptive and cfg.num_draft:
        costs = cfg.round_costs or _estimated_costs(model, cfg)
        if drafting_can_pay(costs, cfg.num_draft):
            return _adaptive_body(model, cfg, sampling, eos, jnp.asarray(costs, jnp.float32), keep_going)
        round_ = Round(RoundKind.PLAIN)
    elif cfg.tree:
        round_ = Round(RoundKind.TREE, cfg.num_draft, cfg.tree)
    else:
        round_ = Round(RoundKind.DRAFT, cfg.num_draft) if cfg.num_draft else Round(RoundKind.PLAIN)
    return _runner(round_context(model, cfg, sampling, eos, [round_]), round_)


def _runner(ctx, round_: Round):
    """One round of kind `round_` as a loop body (state -> state)."""
    run = run_tree_round if round_.kind is RoundKind.TREE else run_round
    return functools.partial(run, ctx, round_)


def _adaptive_body(model, cfg: DecodeConfig, sampling, eos, costs: jax.Array, keep_going):
    """The rounds `choose_round` picks (index c: a probe for 0, c drafts for 1..k, with cfg.tree a tree for k + 1,
    a rest last), a rest only while every active row's MTP block has room or the rest schedule lets it slide, while
    `keep_going` holds (the caller's own loop condition: its loop then stops as soon as that turns false, not after
    this body's rounds).

    The body is a sequence of inner while-loops, one per kind of round, each running while the policy picks its
    kind, rather than a `lax.switch` between the kinds: a branch of a conditional may not update its operands in
    place, so every round through a switch copied the whole trunk cache, while a loop carries its buffers in place.
    Each pass of the body runs at least one round where `keep_going` holds (the loop whose kind is picked runs), so
    the outer loop ends."""
    drafting = [Round(RoundKind.DRAFT, j) for j in range(1, cfg.num_draft + 1)]
    tree = [Round(RoundKind.TREE, cfg.num_draft, cfg.tree)] if cfg.tree else []
    rounds = [Round(RoundKind.PROBE), *drafting, *tree, Round(RoundKind.REST)]
    ctx = round_context(model, cfg, sampling, eos, rounds)  # the draft head gathered once for every kind of round

    def picks(choice: int):
        def cond(s: LoopState) -> jax.Array:
            block_has_room = jnp.all(s.done | (s.block.count < s.block.width))
            may_rest = s.adaptive.schedule.may_rest(block_has_room)
            return keep_going(s) & (choose_round(s.adaptive.tracker, costs, may_rest) == choice)

        return cond

    def body(s: LoopState) -> LoopState:
        for choice, round_ in enumerate(rounds):
            s = jax.lax.while_loop(picks(choice), _runner(ctx, round_), s)
        return s

    return body


def _estimated_costs(model: CausalLM, cfg: DecodeConfig) -> tuple[float, ...]:
    trunk_bytes, draft_bytes = step_param_bytes(model)
    return estimated_round_costs(trunk_bytes, draft_bytes, cfg.num_draft, tree=bool(cfg.tree))


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "greedy"))
def _generate(graphdef, params, prompt_ids, prompt_lens, key, sampling, cfg: DecodeConfig, greedy: bool):
    model: CausalLM = nnx.merge(graphdef, params)
    lone = _lone(model, cfg, prompt_ids.shape[0])
    prompt_ids, prompt_lens, key, sampling = _twinned(lone, prompt_ids, prompt_lens, key, sampling)
    with tracing(model, cfg):
        state = start_state(model, prompt_ids, prompt_lens, key, sampling, cfg, greedy)
        running = lambda s: ~jnp.all(s.done)
        body = round_step(model, cfg, sampling, greedy, running)
        with jax.named_scope(DECODE_LOOP):  # planning reads a round off this loop's body
            state = jax.lax.while_loop(running, body, state)
        return _output(state, cfg, lone)


@contextlib.contextmanager
def tracing(model: CausalLM, cfg: DecodeConfig) -> Iterator[None]:
    """What a decode program is traced under: the model's mesh rules (rows over `data`, heads and vocab over
    `model`), and the config's execution plan (config/execution_plan.py; the plan for here where it names none)."""
    plan = cfg.plan if cfg.plan is not None else traced_plan.resolve(model.sharding_rules, cfg.invariant)
    with activate(model.sharding_rules), traced_plan.tracing(plan):
        yield


def _lone(model: CausalLM, cfg: DecodeConfig, batch: int) -> bool:
    """Whether a batch of `batch` rows decodes beside a twin: a single row under batch-invariant decoding, where a
    one-row pass would get other sums than a row in a batch (`dispatch.lone_rows_exact`)."""
    if not (cfg.invariant and batch == 1):
        return False
    with tracing(model, cfg):  # the config's plan: its products say whether a lone row's sums are its own
        return not lone_rows_exact()


def _twinned(lone: bool, prompt_ids, prompt_lens, key, sampling):
    """The arguments of a lone row under batch-invariant decoding as two identical rows (every op then sees the
    shapes of a batch); as given otherwise."""
    if not lone:
        return prompt_ids, prompt_lens, key, sampling
    key = key if key.ndim else jax.random.split(key, 1)  # the row's own stream, as without the twin
    return jax.tree.map(two_rows, (prompt_ids, prompt_lens, key, sampling))


def _output(state: LoopState, cfg: DecodeConfig, lone: bool) -> GenerateOutput:
    """What `generate` returns from the loop's state (at its end, or between chunks of rounds)."""
    valid = jnp.arange(cfg.max_new_tokens) < state.num_generated[:, None]
    out = GenerateOutput(
        tokens=constrain(jnp.where(valid, state.tokens[:, : cfg.max_new_tokens], 0), ("batch", None)),
        lengths=constrain(state.num_generated, ("batch",)),
        finished_by_eos=constrain(state.finished_by_eos, ("batch",)),
        stats=state.stats,
    )
    return out.first_of_twins() if lone else out


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "greedy", "lone"))
def _start_chunks(graphdef, params, prompt_ids, prompt_lens, key, sampling, cfg, greedy: bool, lone: bool):
    model: CausalLM = nnx.merge(graphdef, params)
    prompt_ids, prompt_lens, key, sampling = _twinned(lone, prompt_ids, prompt_lens, key, sampling)
    with tracing(model, cfg):
        return start_state(model, prompt_ids, prompt_lens, key, sampling, cfg, greedy), sampling


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "greedy", "lone"), donate_argnames=("state",))
def _run_chunk(graphdef, params, state: LoopState, limit, sampling, cfg, greedy: bool, lone: bool):
    """Rounds from `state` until every row is done or has at least `limit` tokens: (state, output so far)."""
    model: CausalLM = nnx.merge(graphdef, params)
    short = lambda s: jnp.any(~s.done & (s.num_generated < limit))
    with tracing(model, cfg):
        state = jax.lax.while_loop(short, round_step(model, cfg, sampling, greedy, short), state)
        return state, _output(state, cfg, lone)


def checked_decode_config(model: CausalLM, cfg: DecodeConfig) -> DecodeConfig:
    """`cfg` as `model` decodes it (batch-invariant where its activations are rounded to int8: see
    DecodeConfig.invariant), with its execution plan (resolved for the model's mesh here where it names none);
    settings the model cannot decode with raise ValueError."""
    if not cfg.invariant and has_int8_activations(model):
        if cfg.plan is not None and not cfg.plan.invariant:
            raise ValueError("this model decodes batch-invariantly (int8 activations): its plan must be invariant")
        cfg = dataclasses.replace(cfg, invariant=True)
    if cfg.plan is None:
        cfg = dataclasses.replace(cfg, plan=traced_plan.resolve(model.sharding_rules, cfg.invariant))
    if cfg.num_draft > 0 and not model.config.has_mtp:
        raise ValueError("num_draft > 0 needs a model with an MTP head; use num_draft=0 for plain decoding")
    if cfg.tree:
        check_tree_model(model, cfg)
    return cfg


def _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling):
    cfg = checked_decode_config(model, cfg or DecodeConfig())
    rules = model.sharding_rules
    if rules is not None and prompt_ids.shape[0] % rules.axis_size("batch"):
        size = rules.axis_size("batch")
        raise ValueError(
            f"a batch of {prompt_ids.shape[0]} rows does not split over the mesh's data axis ({size} shards): "
            f"pad it to a multiple of {size} rows (python -m mtp_jax.decode does)"
        )
    greedy = sampling is None and cfg.temperature == 0
    if sampling is None:
        sampling = SamplingParams.from_config(cfg, prompt_ids.shape[0])
    graphdef, params = nnx.split(model)
    args = (graphdef, params, jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_lens, jnp.int32), key, sampling)
    return args, dict(cfg=cfg, greedy=greedy)


def generate(
    model: CausalLM,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    key: jax.Array,
    cfg: DecodeConfig | None = None,
    sampling: SamplingParams | None = None,
) -> GenerateOutput:
    """Decode a batch of right-padded prompts.

    prompt_ids [B, P] int32 (row b's prompt in its first prompt_lens[b] entries), prompt_lens [B] (>= 1).
    key: one key (split per row) or [B] keys, one random stream per row.
    `sampling` gives per-row temperature / top-k / top-p; without it every row uses `cfg`'s values.
    A pure function of arrays and static configs: callable under `jax.jit`, with sharded params.
    """
    args, static = _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)
    return _generate(*args, **static)


def generate_chunks(
    model: CausalLM,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    key: jax.Array,
    cfg: DecodeConfig | None = None,
    sampling: SamplingParams | None = None,
    chunk_tokens: int = 16,
) -> Iterator[GenerateOutput]:
    """`generate`, as it goes: yields the output so far each time every row not yet done has `chunk_tokens` more
    tokens (at least; a round may add up to k + 1), the last time when every row is done. The rounds are those of
    `generate`, run in pieces (one jitted call per piece, the loop state kept on device between them), so the last
    output is `generate`'s; each earlier one holds a prefix of every row's tokens."""
    (graphdef, params, *inputs), static = _chunk_arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)
    start = lambda params, *inputs: _start_chunks(graphdef, params, *inputs, **static)
    run = lambda params, state, limit, sampling: _run_chunk(graphdef, params, state, limit, sampling, **static)
    return _pieces(start, run, params, inputs, static["cfg"].max_new_tokens, chunk_tokens)


def compile_chunks(model, prompt_ids, prompt_lens, key, cfg=None, sampling=None) -> CompiledChunks:
    """Ahead-of-time compile `generate_chunks`' two programs (the prefill, a piece of rounds) for these shapes."""
    (graphdef, params, *inputs), static = _chunk_arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)

    def compile_both():
        lowered = _start_chunks.lower(graphdef, params, *inputs, **static)
        start = lowered.compile()
        placed = lambda shape, where: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=where)
        state, sampling = jax.tree.map(placed, lowered.out_info, start.output_shardings)  # the prefill's outputs
        return start, _run_chunk.lower(graphdef, params, state, jnp.int32(0), sampling, **static).compile()

    start, run = executable_cache.programs("chunks", (graphdef, params, *inputs, static), compile_both)
    return CompiledChunks(start, run, static["cfg"].max_new_tokens)


def _chunk_arguments(model, prompt_ids, prompt_lens, key, cfg, sampling):
    """`_arguments`, with the static `lone` of the chunked programs (a lone row under batch-invariant decoding)."""
    (graphdef, params, *inputs), static = _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)
    static = {**static, "lone": _lone(model, static["cfg"], inputs[0].shape[0])}
    return (graphdef, params, *inputs), static


class CompiledChunks:
    """`generate_chunks` compiled for one set of shapes and settings; called with its arguments."""

    def __init__(self, start, run, max_new_tokens: int):
        self._start, self._run, self._max_new_tokens = start, run, max_new_tokens
        self._state_sharding = run.input_shardings[0][1]  # the loop state as a piece takes it

    def __call__(self, model, prompt_ids, prompt_lens, key, cfg=None, sampling=None, chunk_tokens: int = 16):
        (_, params, *inputs), _ = _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)
        # On a mesh a piece may hand some small state arrays back laid out otherwise (row counters over `data`
        # where the prefill gave them replicated): put the state as the compiled piece takes it (a no-op else).
        run = lambda params, state, limit, sampling: self._run(
            params, jax.device_put(state, self._state_sharding), limit, sampling
        )
        return _pieces(self._start, run, params, inputs, self._max_new_tokens, chunk_tokens)


def _pieces(start, run, params, inputs, max_new_tokens: int, chunk_tokens: int) -> Iterator[GenerateOutput]:
    """The outputs of `run` (state, limit, sampling -> state, output) from `start`'s state, a piece at a time."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    state, sampling = start(params, *inputs)
    limit = 0
    while True:
        limit = min(limit + chunk_tokens, max_new_tokens)
        state, out = run(params, state, jnp.int32(limit), sampling)
        finished = bool(jnp.all(state.done))
        yield out
        if finished:
            return


def compile_generate(model, prompt_ids, prompt_lens, key, cfg=None, sampling=None, keep: bool = True
                     ) -> CompiledGenerate:  # fmt: skip
    """Ahead-of-time compile `generate` for these shapes: returns a function of the same arguments. `keep`: the
    executable is kept whole on disk while the tools' cache is on (`executable_cache`); a program a run uses only
    once (the default drafting's timed decodes) is not."""
    args, static = _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)
    compile_one = lambda: (_generate.lower(*args, **static).compile(),)
    (program,) = executable_cache.programs("generate", (*args, static), compile_one) if keep else compile_one()
    return CompiledGenerate(program)


class CompiledGenerate:
    """`generate` compiled for one set of shapes and settings; called with `generate`'s arguments."""

    def __init__(self, compiled):
        self._compiled = compiled

    def __call__(self, model, prompt_ids, prompt_lens, key, cfg=None, sampling=None) -> GenerateOutput:
        run_args, _ = _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)
        return self._compiled(*run_args[1:])

    def memory_bytes(self) -> int | None:
        """XLA's count of the device memory the program holds at once: arguments, outputs and temporaries (None
        where the backend does not say)."""
        stats = self._compiled.memory_analysis()
        if stats is None:
            return None
        held = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
        return int(held - stats.alias_size_in_bytes)

    def as_text(self) -> str:
        """The compiled program's HLO text."""
        return self._compiled.as_text()


def eos_ids(model: CausalLM, cfg: DecodeConfig) -> jax.Array:
    """[E] the ids that end a row (none when `cfg.stop_on_eos` is off)."""
    return jnp.asarray(model.config.eos_token_ids if cfg.stop_on_eos else (), jnp.int32).reshape(-1)


def start_state(model: CausalLM, prompt_ids, prompt_lens, key, sampling, cfg: DecodeConfig, greedy: bool) -> LoopState:
    """Traced inside jit, with the model's rules active: the loop state after the prefill, as `generate` starts its
    rounds (prompt_ids [B, P], prompt_lens [B])."""
    batch, prompt_width = prompt_ids.shape
    prompt_ids, prompt_lens = constrain(prompt_ids, ("batch", "seq")), constrain(prompt_lens, ("batch",))
    row_keys = jax.random.split(key, batch) if key.ndim == 0 else key
    sampling = None if greedy else sampling
    slots = cache_slots(prompt_width, cfg, long_cache_shards(model.config, model.sharding_rules))
    return prefill(model, cfg, sampling, eos_ids(model, cfg), prompt_ids, prompt_lens, row_keys, slots)


def round_step(model: CausalLM, cfg: DecodeConfig, sampling, greedy: bool, keep_going):
    """Traced inside jit, with the model's rules active, before the loop: the body of a loop of rounds (state ->
    state) whose condition is `keep_going` (state -> bool), reading the model's quantized weights as prepared here,
    once (`quant.prepare_for_loop`)."""
    return _round_body(prepare_for_loop(model), cfg, None if greedy else sampling, eos_ids(model, cfg), keep_going)


def lower_generate(model: CausalLM, prompt_ids, prompt_lens, key, sampling, cfg: DecodeConfig, greedy: bool):
    """`generate`'s program lowered for these (possibly abstract, sharded) arguments, for inspection or compiling
    for another topology."""
    graphdef, params = nnx.split(model)
    return _generate.lower(graphdef, params, prompt_ids, prompt_lens, key, sampling, cfg=cfg, greedy=greedy)
