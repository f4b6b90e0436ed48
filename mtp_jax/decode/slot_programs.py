"""The jitted programs of an engine with slots (decode/engine.py): B rows of fixed-shape loop state, each a slot that
a request holds from its insert until its row is done.

- `empty_slots`: the loop state of B free slots (every row done; caches of the engine's length and form).
- `insert_rows`: the prefill of n new prompts ([n, P], P a bucketed width), its rows written into slots `where` [n]
  of the state: caches, MTP cache and block, pending token, budget, random stream: everything a row owns starts
  fresh. Leaves shared by all rows (the counters, adaptive decoding's acceptance estimate) are kept. Rows of `where`
  past the last slot are padding and dropped.
- `empty_part`, `extend_part`: a long prompt's caches, prefilled a chunk at a time between pieces of rounds (so the
  running rows wait for a chunk, not for the whole prompt); `insert_rows` then prefills its last chunk after them.
- `run_rounds`: rounds over every slot until a row that was running finishes or `max_rounds` rounds ran (so waiting
  requests get a slot soon). Free slots ride along as done rows, as finished rows of a static batch do.

Every shape is fixed by (B, the engine's cache length) and the insert's bucket (n, P): refilling never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.loop_state import LoopState
from mtp_jax.decode.prefill import PromptPart, prefill, prefill_part
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import eos_ids, round_step, tracing
from mtp_jax.models.causal_lm import CausalLM


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """The static shape of an engine's slots: how many, their caches' length and attention form (kv_cache.py)."""

    slots: int
    cache_slots: int
    attention: str


@struct.dataclass
class SlotView:
    """What the host reads after a piece of rounds: each slot's tokens and whether its row is done."""

    tokens: jax.Array  # [B, max_new_tokens + k + 1]
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    finished_by_eos: jax.Array  # [B] bool

    @classmethod
    def of(cls, state: LoopState) -> SlotView:
        return cls(state.tokens, state.num_generated, state.done, state.finished_by_eos)


def _fresh_rows(model: CausalLM, cfg: DecodeConfig, layout: SlotLayout, greedy: bool, prompt_ids, prompt_lens, keys,
                sampling: SamplingParams, budget, part: PromptPart | None = None) -> LoopState:  # fmt: skip
    """The loop state of the prompts' rows after their prefill (of the last chunk after `part`), in the engine's
    cache shape."""
    return prefill(model, cfg, None if greedy else sampling, eos_ids(model, cfg), prompt_ids, prompt_lens, keys,
                   layout.cache_slots, budget, layout.attention, part)  # fmt: skip


def row_axes(model: CausalLM, cfg: DecodeConfig, layout: SlotLayout, prompt_width: int):
    """The pytree of the loop state with, at each leaf, its row axis (None for leaves every row shares): the axis
    whose size follows the number of rows, found by building the state's shapes for one row and for two."""

    def shapes(rows: int):
        ids = jax.ShapeDtypeStruct((rows, prompt_width), jnp.int32)
        lens = jax.ShapeDtypeStruct((rows,), jnp.int32)
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows))
        sampling = SamplingParams(lens, lens, lens)
        build = functools.partial(_fresh_rows, model, cfg, layout, True)
        return jax.eval_shape(build, ids, lens, keys, sampling, lens)

    def axis(one, two):
        differing = [i for i, (a, b) in enumerate(zip(one.shape, two.shape, strict=True)) if a != b]
        return differing[0] if differing else None

    return jax.tree.map(axis, shapes(1), shapes(2))


def scatter_rows(into, rows, where: jax.Array, axes):
    """`into` (a pytree of B-row leaves) with `rows` (the same pytree of n-row leaves) written at rows `where` [n]
    along each leaf's row axis (`axes`; a None axis keeps `into`'s leaf). Indices past B are dropped."""

    def put(old, new, axis):
        if axis is None:
            return old
        index = (slice(None),) * axis + (where,)
        return old.at[index].set(new.astype(old.dtype), mode="drop")

    return jax.tree.map(put, into, rows, axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "layout"))
def empty_slots(graphdef, params, cfg: DecodeConfig, layout: SlotLayout) -> LoopState:
    """The state of `layout.slots` free slots: every row done, with a budget of 0."""
    model: CausalLM = nnx.merge(graphdef, params)
    rows = layout.slots
    ids, lens = jnp.zeros((rows, 16), jnp.int32), jnp.ones((rows,), jnp.int32)
    keys = jax.random.split(jax.random.key(0), rows)
    sampling = SamplingParams.from_config(cfg, rows)
    with tracing(model, cfg):
        state = _fresh_rows(model, cfg, layout, True, ids, lens, keys, sampling, jnp.zeros((rows,), jnp.int32))
    return state.replace(done=jnp.ones((rows,), bool))


@functools.partial(
    jax.jit, static_argnames=("graphdef", "cfg", "layout", "greedy"), donate_argnames=("state", "sampling")
)
def insert_rows(graphdef, params, state: LoopState, sampling: SamplingParams, prompt_ids, prompt_lens, keys,
                row_sampling: SamplingParams, budget, where, part: PromptPart | None, cfg: DecodeConfig,
                layout: SlotLayout, greedy: bool):  # fmt: skip
    """Prefill prompts [n, P] (lens [n], keys [n], settings and budgets [n]; their last chunk after `part` when
    given) into slots `where` [n]: the new state and slot settings."""
    model: CausalLM = nnx.merge(graphdef, params)
    with tracing(model, cfg):
        fresh = _fresh_rows(model, cfg, layout, greedy, prompt_ids, prompt_lens, keys, row_sampling, budget, part)
        axes = row_axes(model, cfg, layout, prompt_ids.shape[1])
    state = scatter_rows(state, fresh, where, axes)
    sampling = jax.tree.map(lambda old, new: old.at[where].set(new, mode="drop"), sampling, row_sampling)
    return state, sampling


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "layout", "rows"))
def empty_part(graphdef, params, cfg: DecodeConfig, layout: SlotLayout, rows: int) -> PromptPart:
    """Caches of `rows` rows for long prompts prefilled a chunk at a time."""
    model: CausalLM = nnx.merge(graphdef, params)
    with tracing(model, cfg):
        return PromptPart.empty(model, cfg, rows, layout.cache_slots, layout.attention)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("part",))
def extend_part(graphdef, params, part: PromptPart, ids, following, cfg: DecodeConfig) -> PromptPart:
    """`part` over the next chunk of its prompts (ids [n, C], the tokens after it [n])."""
    model: CausalLM = nnx.merge(graphdef, params)
    with tracing(model, cfg):
        return prefill_part(model, cfg, ids, following, part)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "greedy"), donate_argnames=("state",))
def run_rounds(graphdef, params, state: LoopState, sampling: SamplingParams, max_rounds, cfg: DecodeConfig,
               greedy: bool) -> tuple[LoopState, SlotView]:  # fmt: skip
    """Rounds until a running row is done, or `max_rounds` ran."""
    model: CausalLM = nnx.merge(graphdef, params)
    running, last_round = ~state.done, state.stats.rounds + max_rounds

    def more(s: LoopState) -> jax.Array:
        return jnp.any(~s.done) & (s.stats.rounds < last_round) & ~jnp.any(running & s.done)

    with tracing(model, cfg):
        state = jax.lax.while_loop(more, round_step(model, cfg, sampling, greedy, more), state)
    return state, SlotView.of(state)
