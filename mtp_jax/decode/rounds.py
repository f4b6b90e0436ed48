"""One round of the decode loop as small pure functions over its state: draft -> verify -> commit -> record.

A round with j drafts (k = cfg.num_draft, the most a round may draft; n = a row's `position`):
  1. draft: the MTP layer over the MTP block extends the MTP cache over the tokens accepted last round, and its last
     valid slot (position n - 1: h[n-1] with x_n) gives draft d_1; j - 1 more single-token MTP steps, each feeding
     back its own hidden, give d_2..d_j.
  2. verify: the trunk runs [x_n, d_1..d_j] at positions n..n+j in one pass and accepts a drafts plus one token of
     its own (greedy: the longest agreeing prefix; sampling: rejection sampling).
  3. commit: the emitted tokens, clipped at EOS and at the row's budget, go to the output; attention caches roll back
     by length, recurrent states (hybrid trunks) by replay: the verify pass kept its inputs, and each row's state
     before it advances over its a + 1 inputs (`CausalLM.keep_verified`); the verify hiddens and
     emitted tokens become the next MTP block; n advances by a + 1.
  4. record: the counters, and adaptive decoding's acceptance estimate and rest schedule.

The kind of a round (`RoundKind`) says which steps it runs: see there. Every kind is a complete speculative step,
so the output is the same whichever runs.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.config.execution_plan import VerifyLogits
from mtp_jax.decode.loop_state import AdaptiveState, DecodeStats, LoopState, gather_rows, keep_active, round_keys
from mtp_jax.decode.sampling import (
    SamplingParams,
    first_argmax,
    greedy_accept,
    greedy_walk,
    probabilities,
    rejection_accept,
    sample,
)
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.hybrid_stack import RecurrentForm
from mtp_jax.models.kv_cache import KVCache


class RoundKind(enum.Enum):
    DRAFT = "draft"  # j >= 1 drafts, verified in one trunk pass (every round of a loop with fixed k > 0)
    TREE = "tree"  # a draft tree of depth j >= 1 (decode/tree.py), verified in one trunk pass
    PROBE = "probe"  # adaptive, j = 0: a plain step that still runs the MTP layer over the block (catching its
    # cache up) to score its first draft against the target's token, keeping the acceptance estimate current
    REST = "rest"  # adaptive: a plain step that skips the MTP layer and queues its hidden and token in the MTP block
    PLAIN = "plain"  # a plain step that leaves any MTP state alone (k = 0, or adaptive where drafting cannot pay)


@dataclasses.dataclass(frozen=True)
class Round:
    """What one round does (static): its kind, the drafts j it verifies or a tree's depth (>= 1 for DRAFT and TREE,
    else 0), and a tree's node budget."""

    kind: RoundKind
    num_draft: int = 0
    tree: int = 0

    def __post_init__(self):
        drafting = self.kind in (RoundKind.DRAFT, RoundKind.TREE)
        if drafting != (self.num_draft > 0):
            raise ValueError(f"a {self.kind.value} round verifies {'>= 1' if self.num_draft == 0 else 'no'} drafts")
        if (self.kind is RoundKind.TREE) != (self.tree > 0):
            raise ValueError("a tree round, and only one, has a node budget")

    @property
    def runs_mtp(self) -> bool:
        return self.kind in (RoundKind.DRAFT, RoundKind.PROBE, RoundKind.TREE)

    @property
    def offered(self) -> int:
        """Drafts a row's verify pass judges: the chain's, or the tree's nodes."""
        return self.tree or self.num_draft


@dataclasses.dataclass(frozen=True)
class RoundContext:
    """What the rounds of one decode read besides the loop state."""

    model: CausalLM
    cfg: DecodeConfig
    sampling: SamplingParams | None  # per-row settings; None: greedy
    eos: jax.Array  # [E] ids that end a row
    draft_head: jax.Array | None  # [Vd, D] the draft vocabulary's output rows (`CausalLM.draft_head`), or None


def round_context(model: CausalLM, cfg: DecodeConfig, sampling, eos: jax.Array, rounds: list[Round]) -> RoundContext:
    """The context of `rounds`, built outside the decode loop: the draft vocabulary's rows are gathered here, once
    per call for all of them (when one of them drafts), not every draft step."""
    head = model.draft_head() if any(r.runs_mtp for r in rounds) else None
    return RoundContext(model, cfg, sampling, eos, head)


class Drafts(NamedTuple):
    tokens: jax.Array  # [B, j] the drafts the trunk verifies
    probs: jax.Array | None  # [B, j, V] their full-vocabulary distributions when sampling
    first: jax.Array | None  # [B] the first draft (a probe scores it, verifying none); None without the MTP layer
    first_probs: jax.Array | None  # [B, V]
    mtp_cache: KVCache | None  # extended over the block and the drafts; None without the MTP layer


class Verdict(NamedTuple):
    accepted: jax.Array  # [B] drafts accepted (a)
    token: jax.Array  # [B] the target's token after them
    hidden: jax.Array  # [B, j+1, D] the verify block's draft hiddens (`CausalLM.trunk_for_drafts`) for the MTP block
    cache: tuple  # trunk cache, per segment, after the block (recurrent states after every position, until `commit`)
    target_probs: jax.Array | None  # [B, j+1, V] when sampling


def choose(sampling: SamplingParams | None, logits: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Pick ids [B, ...] from float32 logits [B, ..., V]; also return the distribution when sampling."""
    if sampling is None:
        return first_argmax(logits), None
    probs = probabilities(logits, sampling)
    return jax.vmap(sample)(keys, probs), probs


def catch_up(ctx: RoundContext, s: LoopState) -> tuple[jax.Array, jax.Array, KVCache]:
    """The MTP layer over the block (extending the MTP cache): hidden and normed output [B, D] of each row's last
    valid slot. Over the first k + 1 slots unless an active row has rested tokens past them."""
    block = s.block

    def over(width: int):
        def run(operands):
            hidden, tokens, start, count, mtp_cache = operands
            slots = jnp.arange(width)
            hidden, normed, mtp_cache = ctx.model.mtp_step(
                hidden[:, :width], tokens[:, :width], start[:, None] + slots, mtp_cache, block.visible_from
            )
            last = jnp.minimum(count, width) - 1  # done rows may hold more; their results are dropped
            return gather_rows(hidden, last), gather_rows(normed, last), mtp_cache

        return run

    operands = (block.hidden, block.tokens, block.start, block.count, s.mtp_cache)
    narrow = ctx.cfg.num_draft + 1
    if block.width == narrow:
        return over(narrow)(operands)
    fits = jnp.all(s.done | (block.count <= narrow))
    return jax.lax.cond(fits, over(narrow), over(block.width), operands)


def full_vocabulary(model: CausalLM, probs: jax.Array) -> jax.Array:
    """Draft-vocabulary probabilities [B, Vd] -> full-vocabulary [B, V] (zero outside the subset)."""
    if model.draft_vocab is None:
        return probs
    full = jnp.zeros((probs.shape[0], model.config.vocab_size), probs.dtype)
    return full.at[:, model.draft_vocab[...]].set(probs)


def no_drafts(s: LoopState) -> Drafts:
    """A round without the MTP layer: nothing to verify but the pending token."""
    return Drafts(jnp.zeros((s.pending.shape[0], 0), jnp.int32), None, None, None, None)


def draft(ctx: RoundContext, round_: Round, s: LoopState) -> Drafts:
    """The MTP layer's max(j, 1) drafts (a probe makes one, to score it)."""
    model = ctx.model
    hidden, normed, mtp_cache = catch_up(ctx, s)  # [B, D]
    position = s.position  # the next draft step's slot (the first sat at position - 1)
    tokens, dists = [], []
    for i in range(max(round_.num_draft, 1)):
        keys = round_keys(s.row_keys, s.num_generated, 10 + i)
        index, probs = choose(ctx.sampling, model.draft_logits(normed, ctx.draft_head), keys)
        token = model.draft_ids(index)
        tokens.append(token)
        if probs is not None:
            dists.append(full_vocabulary(model, probs))
        if i + 1 < round_.num_draft:
            hidden, normed, mtp_cache = model.mtp_step(
                hidden[:, None], token[:, None], (position + i)[:, None], mtp_cache, s.block.visible_from
            )
            hidden, normed = hidden[:, 0], normed[:, 0]
    probs = jnp.stack(dists, axis=1) if dists else None  # [B, max(j, 1), V]
    tokens = jnp.stack(tokens, axis=1)  # [B, max(j, 1)]
    j = round_.num_draft
    first, first_probs = tokens[:, 0], None if probs is None else probs[:, 0]
    return Drafts(tokens[:, :j], None if probs is None else probs[:, :j], first, first_probs, mtp_cache)


def verify(ctx: RoundContext, s: LoopState, drafts: jax.Array, draft_probs: jax.Array | None, cache,
           feeds_mtp: bool = True) -> Verdict:  # fmt: skip
    """The trunk over [pending, drafts] ([B, j+1]) from `cache`, and the drafts it accepts. `feeds_mtp`: the
    verdict's hiddens go to the MTP block (the draft hiddens, `CausalLM.trunk_for_drafts`), else the final ones."""
    model, j = ctx.model, drafts.shape[1]
    inputs = jnp.concatenate([s.pending[:, None], drafts], axis=1)  # [B, j+1]
    positions = s.position[:, None] + jnp.arange(j + 1)
    # A plain step (no drafts) keeps its one state; a verify block its inputs, until acceptance is known.
    recurrent = RecurrentForm.EVERY_STATE if j else RecurrentForm.LAST_STATE
    if feeds_mtp:
        hidden, draft_hidden, cache = model.trunk_for_drafts(inputs, positions, cache, recurrent=recurrent)
    else:
        hidden, cache = model.trunk(inputs, positions, cache, recurrent=recurrent)
        draft_hidden = hidden
    if ctx.sampling is None:
        if row_by_row_logits(ctx.cfg, inputs.shape[0], j):
            chain = jnp.broadcast_to(jnp.arange(j), drafts.shape)  # draft i's parent: entry i
            accepted, token, _ = greedy_walk(drafts, chain, hidden, model.logits)
        else:
            accepted, token = greedy_accept(drafts, model.logits(hidden))
        return Verdict(accepted, token, draft_hidden, cache, None)
    logits = model.logits(hidden)  # [B, j+1, V]
    target_probs = probabilities(logits, ctx.sampling)
    keys = round_keys(s.row_keys, s.num_generated, 1)
    if j == 0:
        accepted, token = jnp.zeros_like(s.pending), jax.vmap(sample)(keys, target_probs[:, 0])
    else:
        accepted, token = jax.vmap(rejection_accept)(keys, drafts, draft_probs, target_probs)
    return Verdict(accepted, token, draft_hidden, cache, target_probs)


# Where the plan says ROW_BY_ROW, a greedy verify block of at most ROW_BY_ROW_BATCH rows (one row, or one with its
# twin) and at least ROW_BY_ROW_DRAFTS drafts (a chain's, or a tree's nodes) makes its logits a position at a time:
# more rows rarely all reject a draft, and each position's pass reads the whole lm_head again. Measured on the
# default model at batch 1 (docs/benchmarks-log.md), whole decodes against the block's: a 16-node tree 0.76x the
# time, k = 3 0.93-0.98x, k = 2 1.05x (so two drafts keep the block).
ROW_BY_ROW_BATCH = 2
ROW_BY_ROW_DRAFTS = 3


def row_by_row_logits(cfg: DecodeConfig, batch: int, num_draft: int) -> bool:
    """Whether a greedy verify block of `batch` rows and `num_draft` drafts makes its logits a position at a time."""
    wanted = cfg.plan is not None and cfg.plan.verify_logits is VerifyLogits.ROW_BY_ROW
    return wanted and batch <= ROW_BY_ROW_BATCH and num_draft >= ROW_BY_ROW_DRAFTS


def emitted_tokens(ctx: RoundContext, s: LoopState, drafts: jax.Array, verdict: Verdict) -> tuple[jax.Array, ...]:
    """The tokens a round emits, d_1..d_a then the target's token: (tokens [B, j+1], valid for slot <= a; how many
    each row keeps [B], clipped at EOS and at the budget, 0 for rows already done; rows stopped by EOS [B])."""
    active = ~s.done
    accepted, (batch, j) = verdict.accepted, drafts.shape
    slot = jnp.arange(j + 1)
    padded = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, j+1]
    emitted = jnp.where(slot < accepted[:, None], padded, verdict.token[:, None])
    if ctx.eos.size:
        is_eos = jnp.isin(emitted, ctx.eos) & (slot <= accepted[:, None])
        hit_eos, eos_index = jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1)
    else:  # nothing stops a row (and XLA would spend seconds constant-folding the empty search)
        hit_eos, eos_index = jnp.zeros_like(active), jnp.zeros_like(accepted)
    count = jnp.where(hit_eos, eos_index + 1, accepted + 1)
    count = jnp.where(active, jnp.minimum(count, s.budget - s.num_generated), 0)
    return emitted, count, active & hit_eos & (eos_index < count)


def commit(ctx: RoundContext, round_: Round, s: LoopState, drafts: Drafts, verdict: Verdict) -> LoopState:
    """Take the verdict: the trunk cache rolled back to each row's accepted inputs, the emitted tokens written, each
    active row advanced by a + 1, and the MTP block refilled (DRAFT, PROBE) or the rest queued in it (REST)."""
    active, batch = ~s.done, s.pending.shape[0]
    cache = verdict.cache
    if round_.num_draft:  # recurrent states: each row's state before the block replayed over its accepted inputs
        cache = ctx.model.keep_verified(s.cache, cache, verdict.accepted, active)
    emitted, count, eos_now = emitted_tokens(ctx, s, drafts.tokens, verdict)
    slot = jnp.arange(emitted.shape[1])
    write_at = jnp.where(slot < count[:, None], s.num_generated[:, None] + slot, s.tokens.shape[1])
    num_generated = s.num_generated + count
    state = s.replace(
        tokens=s.tokens.at[jnp.arange(batch)[:, None], write_at].set(emitted, mode="drop"),
        num_generated=num_generated,
        done=s.done | eos_now | (num_generated >= s.budget),
        finished_by_eos=s.finished_by_eos | eos_now,
        position=keep_active(active, s.position + verdict.accepted + 1, s.position),
        pending=keep_active(active, verdict.token, s.pending),
        cache=cache,
    )
    if round_.kind is RoundKind.REST:  # full rows slide the block
        full = s.block.count >= s.block.width  # [B]
        block = s.block.queued(active & ~full, active & full, verdict.hidden[:, 0], emitted[:, 0])
        return state.replace(block=block)
    if round_.runs_mtp:
        block = s.block.verified(active, s.position, verdict.accepted, verdict.hidden, emitted)
        return state.replace(mtp_cache=drafts.mtp_cache, block=block)
    return state


def record(
    ctx: RoundContext, round_: Round, s: LoopState, state: LoopState, drafts: Drafts, verdict: Verdict
) -> LoopState:
    """`state` with the round counted in its statistics and, adaptive decoding, its rest schedule and acceptance
    estimate moved on (a PLAIN round leaves them)."""
    active, accepted = ~s.done, verdict.accepted
    max_k, j = ctx.cfg.num_draft, round_.num_draft
    depth = jnp.arange(max_k)
    judged = active[:, None] & (accepted[:, None] >= depth) & (depth < j)  # [B, max_k]
    passed = active[:, None] & (accepted[:, None] > depth)  # [B, max_k]
    skips_mtp = max_k > 0 and not round_.runs_mtp
    stats = DecodeStats(
        rounds=s.stats.rounds + 1,
        row_rounds=s.stats.row_rounds + jnp.sum(active),
        emitted=s.stats.emitted + jnp.sum(jnp.where(active, accepted + 1, 0)),
        drafted=s.stats.drafted + round_.offered * jnp.sum(active),
        accepted=s.stats.accepted + jnp.sum(jnp.where(active, accepted, 0)),
        reached=s.stats.reached + jnp.sum(judged, axis=0),
        accepted_at=s.stats.accepted_at + jnp.sum(passed, axis=0),
        rounds_with=s.stats.rounds_with.at[j].add(1),
        rests=s.stats.rests + int(skips_mtp),
        tree_rounds=s.stats.tree_rounds + int(round_.kind is RoundKind.TREE),
    )
    state = state.replace(stats=stats)
    if s.adaptive is None or round_.kind is RoundKind.PLAIN:
        return state
    tracker, schedule = s.adaptive.tracker, s.adaptive.schedule
    if round_.kind is RoundKind.REST:
        schedule = schedule.after_rest(jnp.any(active & (s.block.count >= s.block.width)))
    else:
        schedule = schedule.after_probe(s.block.width) if j == 0 else schedule.after_draft()
        hits, trials = observed_acceptance(round_, s, drafts, verdict, judged, passed)
        tree = round_.kind is RoundKind.TREE
        tracker = tracker.update(hits.astype(jnp.float32), trials.astype(jnp.float32), tree=tree)
    return state.replace(adaptive=AdaptiveState(tracker=tracker, schedule=schedule))


def observed_acceptance(round_: Round, s: LoopState, drafts: Drafts, verdict: Verdict, judged, passed):
    """This round's evidence for the acceptance estimate: (hits [k], trials [k]) over active rows. A probe judged no
    draft, so its first draft is scored against the target's token instead."""
    if round_.kind is not RoundKind.PROBE:
        return jnp.sum(passed, axis=0), jnp.sum(judged, axis=0)
    active, max_k = ~s.done, judged.shape[1]
    if verdict.target_probs is None:
        agreement = (drafts.first == verdict.token).astype(jnp.float32)
    else:  # the probability that rejection sampling would have accepted it
        agreement = jnp.sum(jnp.minimum(verdict.target_probs[:, 0], drafts.first_probs), axis=-1)
    hits = jnp.zeros((max_k,)).at[0].set(jnp.sum(jnp.where(active, agreement, 0.0)))
    trials = jnp.zeros((max_k,)).at[0].set(jnp.sum(active))
    return hits, trials


def run_round(ctx: RoundContext, round_: Round, s: LoopState) -> LoopState:
    """One round of kind `round_` (a `lax.while_loop` body once `ctx` and `round_` are bound)."""
    drafts = draft(ctx, round_, s) if round_.runs_mtp else no_drafts(s)
    verdict = verify(ctx, s, drafts.tokens, drafts.probs, s.cache, feeds_mtp=round_.kind is not RoundKind.PLAIN)
    state = commit(ctx, round_, s, drafts, verdict)
    return record(ctx, round_, s, state, drafts, verdict)
