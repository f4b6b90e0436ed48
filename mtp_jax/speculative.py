"""`generate`: MTP self-speculative decoding as one jitted `lax.while_loop` over fixed shapes.

Sequence bookkeeping for a row (n = `position`, the slot of the pending token):
  trunk cache valid for slots < n; the pending token x_n is generated but not yet run through the trunk;
  the MTP cache is valid for slots < `mtp_start`; the "MTP block" holds the trunk hiddens h[mtp_start + j]
  with their next tokens x[mtp_start + j + 1] for j < `mtp_count`, where mtp_start + mtp_count = n.

One round (k = num_draft):
  1. MTP over the block (k+1 slots): extends the MTP cache over the tokens accepted last round, and its last
     valid slot (position n - 1: h[n-1] with x_n) gives draft d_1.
  2. k - 1 more single-token MTP steps, each feeding back its own hidden, give d_2..d_k.
  3. The trunk verifies [x_n, d_1..d_k] at positions n..n+k in one pass.
  4. Accept a drafts plus one token from the target; clip at EOS and at max_new_tokens. Attention caches roll
     back by length; recurrent states (hybrid trunks) by selection: the verify pass kept the state after every
     block position and each row keeps the one after its a + 1 inputs (`CausalLM.keep_verified`).
  5. The verify hiddens and accepted tokens become the next MTP block; n advances by a + 1.
k = 0 skips 1-2 and is plain decoding through the same code.
Adaptive decoding (cfg.adaptive) compiles a round for every j = 0..k and a rest, and moves between them on device
(mtp_jax.adaptive picks; `_round_body`). A round with j = 0 (a probe) still runs step 1, to score a draft; a rest is
a plain step that skips the MTP layer and appends its hidden and token to the MTP block, which for adaptive decoding
has REST_ROUNDS spare slots; the next round with MTP catches the MTP cache up over all of them. Long rests slide the
block instead (mtp_jax.adaptive.RestSchedule): the MTP cache then skips the dropped positions, and `mtp_visible_from`
hides everything before the block from the MTP layer's attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mtp_jax.adaptive import (
    AcceptanceTracker,
    RestSchedule,
    choose_round,
    drafting_can_pay,
    estimated_round_costs,
    probe_cycle,
    step_param_bytes,
)
from mtp_jax.cache import KVCache, long_cache_shards
from mtp_jax.config import DecodeConfig
from mtp_jax.models.cache_attention import ATTENTION_CHUNK, chunk_count, two_rows
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.sampling import SamplingParams, greedy_accept, probabilities, rejection_accept, sample
from mtp_jax.sharding import activate, constrain


@struct.dataclass
class DecodeStats:
    """Counters summed over rows. A row-round is one verify pass of a row that was not done."""

    rounds: jax.Array  # [] loop iterations
    row_rounds: jax.Array  # [] active row-rounds
    emitted: jax.Array  # [] tokens the verify passes produced (a + 1 per row-round, before EOS/budget clipping)
    drafted: jax.Array  # [] drafts proposed to active rows
    accepted: jax.Array  # [] drafts accepted
    reached: jax.Array  # [k] row-rounds in which draft i was judged (all earlier drafts accepted)
    accepted_at: jax.Array  # [k] row-rounds in which draft i was accepted
    rounds_with: jax.Array  # [k+1] loop iterations that drafted j = 0..k tokens
    rests: jax.Array  # [] loop iterations that skipped the MTP layer (adaptive decoding; counted in rounds_with[0])


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


@struct.dataclass
class LoopState:
    tokens: jax.Array  # [B, max_new_tokens + k + 1] output buffer
    num_generated: jax.Array  # [B] tokens in `tokens` (the pending token included)
    done: jax.Array  # [B] bool
    finished_by_eos: jax.Array  # [B] bool
    position: jax.Array  # [B] slot of the pending token
    pending: jax.Array  # [B] last generated token, not yet in the trunk cache
    cache: KVCache  # trunk, [L, B, S, K, H] (or per segment; hybrid trunks: GroupCache with DeltaNet states)
    mtp_cache: KVCache | None  # [1, B, S, K, H]
    mtp_hidden: jax.Array | None  # [B, W, D], W = mtp_block_width(cfg)
    mtp_tokens: jax.Array | None  # [B, W]
    mtp_start: jax.Array | None  # [B]
    mtp_count: jax.Array | None  # [B]
    mtp_visible_from: jax.Array | None  # [B] adaptive decoding: MTP cache slots before it are stale (skipped)
    row_keys: jax.Array  # [B] one random stream per row
    stats: DecodeStats
    tracker: AcceptanceTracker | None  # adaptive decoding only
    rest_schedule: RestSchedule | None  # adaptive decoding only


def _row_keys(row_keys: jax.Array, round_index: jax.Array, purpose: int) -> jax.Array:
    """A fresh key per row for this round and purpose: [B] keys."""
    return jax.vmap(lambda k: jax.random.fold_in(jax.random.fold_in(k, round_index), purpose))(row_keys)


def mtp_block_width(cfg: DecodeConfig) -> int:
    """Slots W of the MTP block: the k + 1 a round can accept, and REST_ROUNDS more for adaptive decoding's rests."""
    return probe_cycle(cfg.num_draft) if cfg.adaptive and cfg.num_draft > 0 else cfg.num_draft + 1


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...], index [B] -> x[b, index[b]] : [B, ...]."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


class _Round:
    """One round with `num_draft` = j drafts (j <= cfg.num_draft). Adaptive decoding also has plain steps that skip
    the MTP layer: with `rest`, one that queues its hidden and token in the MTP block (when the block has room); with
    `plain`, one that leaves the MTP state alone (when round costs say drafting can never pay)."""

    def __init__(self, model: CausalLM, cfg: DecodeConfig, sampling: SamplingParams | None, eos: jax.Array,
                 num_draft: int, rest: bool = False, plain: bool = False,
                 draft_head: jax.Array | None = None):  # fmt: skip
        self.model, self.cfg, self.sampling, self.eos = model, cfg, sampling, eos
        self.k, self.max_k, self.rest, self.plain = num_draft, cfg.num_draft, rest, plain
        self.skips_mtp = rest or plain
        self.width = mtp_block_width(cfg)
        # Taken where the round is built, outside the decode loop, so the draft vocabulary's gather runs once per call
        # (an adaptive body's rounds share the one `_round_body` passes).
        if draft_head is None and cfg.num_draft > 0 and not self.skips_mtp:
            draft_head = model.draft_head()
        self.draft_head = draft_head

    def choose(self, logits: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Pick ids [B, ...] from float32 logits [B, ..., V]; also return the distribution when sampling."""
        if self.sampling is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        probs = probabilities(logits, self.sampling)
        return jax.vmap(sample)(keys, probs), probs

    def catch_up(self, s: LoopState) -> tuple[jax.Array, jax.Array, KVCache]:
        """The MTP layer over the block (extending the MTP cache): hidden and normed output [B, D] of each row's last
        valid slot. Over the first k + 1 slots unless an active row has rested tokens past them."""

        def over(width: int):
            def run(block):
                hidden, tokens, start, count, mtp_cache = block
                slots = jnp.arange(width)
                hidden, normed, mtp_cache = self.model.mtp_step(
                    hidden[:, :width], tokens[:, :width], start[:, None] + slots, mtp_cache, s.mtp_visible_from
                )
                last = jnp.minimum(count, width) - 1  # done rows may hold more; their results are dropped
                return _gather_rows(hidden, last), _gather_rows(normed, last), mtp_cache

            return run

        block = (s.mtp_hidden, s.mtp_tokens, s.mtp_start, s.mtp_count, s.mtp_cache)
        narrow = self.max_k + 1
        if self.width == narrow:
            return over(narrow)(block)
        fits = jnp.all(s.done | (s.mtp_count <= narrow))
        return jax.lax.cond(fits, over(narrow), over(self.width), block)

    def draft(self, s: LoopState) -> tuple[jax.Array, jax.Array | None, KVCache]:
        """max(j, 1) drafts [B, .] (and their full-vocabulary probabilities [B, ., V] when sampling)."""
        model = self.model
        hidden, normed, mtp_cache = self.catch_up(s)  # [B, D]
        position = s.position  # the next draft step's slot (the first sat at position - 1)
        drafts, dists = [], []
        for i in range(max(self.k, 1)):
            keys = _row_keys(s.row_keys, s.stats.rounds, 10 + i)
            index, probs = self.choose(model.draft_logits(normed, self.draft_head), keys)
            token = model.draft_ids(index)
            drafts.append(token)
            if probs is not None:
                dists.append(self.scatter_draft_probs(probs))
            if i + 1 < self.k:
                hidden, normed, mtp_cache = model.mtp_step(
                    hidden[:, None], token[:, None], (position + i)[:, None], mtp_cache, s.mtp_visible_from
                )
                hidden, normed = hidden[:, 0], normed[:, 0]
        draft_probs = jnp.stack(dists, axis=1) if dists else None
        return jnp.stack(drafts, axis=1), draft_probs, mtp_cache

    def scatter_draft_probs(self, probs: jax.Array) -> jax.Array:
        """Draft-vocabulary probabilities [B, Vd] -> full-vocabulary [B, V] (zero outside the subset)."""
        if self.model.draft_vocab is None:
            return probs
        full = jnp.zeros((probs.shape[0], self.model.config.vocab_size), probs.dtype)
        return full.at[:, self.model.draft_vocab[...]].set(probs)

    def verify(self, s, drafts, draft_probs, cache):
        """Trunk over [pending, drafts]: (accepted count [B], next token [B], hiddens [B, j+1, D], cache,
        target probabilities [B, j+1, V] or None when greedy)."""
        inputs = jnp.concatenate([s.pending[:, None], drafts], axis=1)  # [B, j+1]
        positions = s.position[:, None] + jnp.arange(self.k + 1)
        # A plain step (no drafts) keeps its one state; a verify block every position's, until acceptance is known.
        recurrent = "every_state" if self.k else "last_state"
        hidden, cache = self.model.trunk(inputs, positions, cache, recurrent=recurrent)
        logits = self.model.logits(hidden)  # [B, j+1, V]
        if self.sampling is None:
            accepted, token = greedy_accept(drafts, logits)
            return accepted, token, hidden, cache, None
        target_probs = probabilities(logits, self.sampling)
        keys = _row_keys(s.row_keys, s.stats.rounds, 1)
        if self.k == 0:
            accepted, token = jnp.zeros_like(s.pending), jax.vmap(sample)(keys, target_probs[:, 0])
        else:
            accepted, token = jax.vmap(rejection_accept)(keys, drafts, draft_probs, target_probs)
        return accepted, token, hidden, cache, target_probs

    def __call__(self, s: LoopState) -> LoopState:
        k, max_k, cfg = self.k, self.max_k, self.cfg
        active = ~s.done
        batch = s.pending.shape[0]
        if max_k > 0 and not self.skips_mtp:
            drafts, draft_probs, mtp_cache = self.draft(s)
            guess, guess_probs = drafts[:, 0], None if draft_probs is None else draft_probs[:, 0]
            drafts, draft_probs = drafts[:, :k], None if draft_probs is None else draft_probs[:, :k]
        else:
            drafts, draft_probs, mtp_cache = jnp.zeros((batch, 0), jnp.int32), None, None
        accepted, token, hidden, cache, target_probs = self.verify(s, drafts, draft_probs, s.cache)
        if k:  # recurrent states roll back by selection: each row keeps the state after its last accepted input
            cache = self.model.keep_verified(s.cache, cache, accepted, active)

        # Tokens this round emits: d_1..d_a then the target's token; clipped at EOS and at the budget.
        slot = jnp.arange(k + 1)
        padded = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, j+1]
        emitted = jnp.where(slot < accepted[:, None], padded, token[:, None])  # valid for slot <= a
        if self.eos.size:
            is_eos = jnp.isin(emitted, self.eos) & (slot <= accepted[:, None])
            hit_eos, eos_index = jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1)
        else:  # nothing stops a row (and XLA would spend seconds constant-folding the empty search)
            hit_eos, eos_index = jnp.zeros_like(active), jnp.zeros_like(accepted)
        count = jnp.where(hit_eos, eos_index + 1, accepted + 1)
        count = jnp.where(active, jnp.minimum(count, cfg.max_new_tokens - s.num_generated), 0)
        write_at = jnp.where(slot < count[:, None], s.num_generated[:, None] + slot, s.tokens.shape[1])
        tokens = s.tokens.at[jnp.arange(batch)[:, None], write_at].set(emitted, mode="drop")
        num_generated = s.num_generated + count
        eos_now = active & hit_eos & (eos_index < count)
        done = s.done | eos_now | (num_generated >= cfg.max_new_tokens)

        depth = jnp.arange(max_k)
        judged = active[:, None] & (accepted[:, None] >= depth) & (depth < k)  # [B, max_k]
        passed = active[:, None] & (accepted[:, None] > depth)  # [B, max_k]
        stats = DecodeStats(
            rounds=s.stats.rounds + 1,
            row_rounds=s.stats.row_rounds + jnp.sum(active),
            emitted=s.stats.emitted + jnp.sum(jnp.where(active, accepted + 1, 0)),
            drafted=s.stats.drafted + k * jnp.sum(active),
            accepted=s.stats.accepted + jnp.sum(jnp.where(active, accepted, 0)),
            reached=s.stats.reached + jnp.sum(judged, axis=0),
            accepted_at=s.stats.accepted_at + jnp.sum(passed, axis=0),
            rounds_with=s.stats.rounds_with.at[k].add(1),
            rests=s.stats.rests + int(self.skips_mtp),
        )
        keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
        state = s.replace(
            tokens=tokens,
            num_generated=num_generated,
            done=done,
            finished_by_eos=s.finished_by_eos | eos_now,
            position=keep(s.position + accepted + 1, s.position),
            pending=keep(token, s.pending),
            cache=cache,
            stats=stats,
        )
        full = s.mtp_count >= self.width if self.rest else None  # [B] rows whose rest slides the MTP block
        if self.rest:
            state = self.queue(state, s, active & ~full, active & full, hidden[:, 0], emitted[:, 0])
        elif max_k > 0 and not self.plain:
            widen = lambda x: jnp.pad(x, [(0, 0), (0, self.width - k - 1)] + [(0, 0)] * (x.ndim - 2))  # -> [B, W]
            state = state.replace(
                mtp_cache=mtp_cache,
                mtp_hidden=keep(widen(hidden), s.mtp_hidden),
                mtp_tokens=keep(widen(emitted), s.mtp_tokens),
                mtp_start=keep(s.position, s.mtp_start),
                mtp_count=keep(accepted + 1, s.mtp_count),
            )
        if s.rest_schedule is not None and not self.plain:
            schedule = s.rest_schedule
            if self.rest:
                schedule = schedule.after_rest(jnp.any(active & full))
            else:
                schedule = schedule.after_probe(self.width) if k == 0 else schedule.after_draft()
            state = state.replace(rest_schedule=schedule)
        if s.tracker is not None and not self.skips_mtp:
            if k == 0:  # no draft was judged: score the first draft against the target's token instead
                if target_probs is None:
                    agreement = (guess == token).astype(jnp.float32)
                else:  # the probability that rejection sampling would have accepted it
                    agreement = jnp.sum(jnp.minimum(target_probs[:, 0], guess_probs), axis=-1)
                hits = jnp.zeros((max_k,)).at[0].set(jnp.sum(jnp.where(active, agreement, 0.0)))
                trials = jnp.zeros((max_k,)).at[0].set(jnp.sum(active))
            else:
                hits, trials = jnp.sum(passed, axis=0), jnp.sum(judged, axis=0)
            state = state.replace(tracker=s.tracker.update(hits.astype(jnp.float32), trials.astype(jnp.float32)))
        return state

    def queue(self, state: LoopState, s: LoopState, grow, slide, hidden, token) -> LoopState:
        """A rest's (h[n] [B, D], x[n+1] [B]) into the MTP block of each active row: into its next slot where it has
        room (`grow` [B]); where it is full (`slide` [B]) the block slides, dropping its oldest entry: the MTP cache
        will skip that position, so the MTP layer attends to none of its cache before the block's new start. The
        MTP cache waits for the next catch-up."""
        append = grow[:, None] & (jnp.arange(self.width) == s.mtp_count[:, None])  # [B, W]
        slid_hidden = jnp.concatenate([s.mtp_hidden[:, 1:], hidden[:, None]], axis=1)  # [B, W, D]
        slid_tokens = jnp.concatenate([s.mtp_tokens[:, 1:], token[:, None]], axis=1)  # [B, W]
        start = jnp.where(slide, s.mtp_start + 1, s.mtp_start)
        return state.replace(
            mtp_hidden=jnp.where(slide[:, None, None], slid_hidden, jnp.where(append[..., None], hidden[:, None],
                                                                               s.mtp_hidden)),
            mtp_tokens=jnp.where(slide[:, None], slid_tokens, jnp.where(append, token[:, None], s.mtp_tokens)),
            mtp_start=start,
            mtp_count=jnp.where(grow, s.mtp_count + 1, s.mtp_count),
            mtp_visible_from=jnp.where(slide, start, s.mtp_visible_from),
        )  # fmt: skip


def _round_body(model, cfg: DecodeConfig, sampling, eos):
    """The while-loop body: a round with cfg.num_draft drafts, or, adaptive, the rounds the policy picks (j = 0..k
    drafts, or a rest while every active row's MTP block has room). Where the round costs say no draft can pay,
    adaptive decoding is plain decoding.

    The adaptive body is a sequence of inner while-loops, one per kind of round, each running while the policy picks
    its kind, rather than a `lax.switch` between the kinds: a branch of a conditional may not update its operands in
    place, so every round through a switch copied the whole trunk cache, while a loop carries its buffers in place.
    Each pass of the body runs at least one round (the loop whose kind is picked runs), so the outer loop ends when
    every row is done."""
    if not cfg.adaptive or cfg.num_draft == 0:
        return _Round(model, cfg, sampling, eos, cfg.num_draft)
    costs = cfg.round_costs or _estimated_costs(model, cfg.num_draft)
    if not drafting_can_pay(costs):
        return _Round(model, cfg, sampling, eos, 0, plain=True)
    width = mtp_block_width(cfg)
    costs = jnp.asarray(costs, jnp.float32)
    head = model.draft_head()  # [Vd, D] or None, gathered once for every kind of round
    rounds = [_Round(model, cfg, sampling, eos, j, draft_head=head) for j in range(cfg.num_draft + 1)]
    rounds.append(_Round(model, cfg, sampling, eos, 0, rest=True))  # choice k + 1

    def picks(choice: int):
        def cond(s: LoopState) -> jax.Array:
            may_rest = s.rest_schedule.may_rest(jnp.all(s.done | (s.mtp_count < width)))
            return ~jnp.all(s.done) & (choose_round(s.tracker, costs, may_rest) == choice)

        return cond

    def body(s: LoopState) -> LoopState:
        for choice, round_ in enumerate(rounds):
            s = jax.lax.while_loop(picks(choice), round_, s)
        return s

    return body


def _estimated_costs(model: CausalLM, max_draft: int) -> tuple[float, ...]:
    trunk_bytes, draft_bytes = step_param_bytes(model)
    return estimated_round_costs(trunk_bytes, draft_bytes, max_draft)


def _prefill(model, cfg, sampling, eos, prompt_ids, prompt_lens, row_keys, slots) -> LoopState:
    """Trunk (and MTP) over the padded prompts; the first token from each row's last prompt position."""
    batch, prompt_width = prompt_ids.shape
    k = cfg.num_draft
    positions = jnp.broadcast_to(jnp.arange(prompt_width), (batch, prompt_width))
    cache = model.new_cache(batch, slots, cfg.invariant)
    hidden, cache = model.trunk(prompt_ids, positions, cache, lengths=prompt_lens)  # [B, P, D]
    last = prompt_lens - 1
    last_hidden = _gather_rows(hidden, last)  # [B, D]
    logits = model.logits(last_hidden)
    if sampling is None:
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        keys = _row_keys(row_keys, jnp.int32(-1), 0)
        first = jax.vmap(sample)(keys, probabilities(logits[:, None], sampling)[:, 0])
    tokens = jnp.zeros((batch, cfg.max_new_tokens + k + 1), jnp.int32).at[:, 0].set(first)
    hit_eos = jnp.isin(first, eos)
    stats = DecodeStats(
        rounds=jnp.int32(0),
        row_rounds=jnp.int32(0),
        emitted=jnp.int32(0),
        drafted=jnp.int32(0),
        accepted=jnp.int32(0),
        reached=jnp.zeros((k,), jnp.int32),
        accepted_at=jnp.zeros((k,), jnp.int32),
        rounds_with=jnp.zeros((k + 1,), jnp.int32),
        rests=jnp.int32(0),
    )
    state = LoopState(
        tokens=tokens,
        num_generated=jnp.ones((batch,), jnp.int32),
        done=hit_eos | (cfg.max_new_tokens <= 1),
        finished_by_eos=hit_eos,
        position=prompt_lens,
        pending=first,
        cache=cache,
        mtp_cache=None,
        mtp_hidden=None,
        mtp_tokens=None,
        mtp_start=None,
        mtp_count=None,
        mtp_visible_from=None,
        row_keys=row_keys,
        stats=stats,
        tracker=AcceptanceTracker.start(k) if cfg.adaptive and k > 0 else None,
        rest_schedule=RestSchedule.start() if cfg.adaptive and k > 0 else None,
    )
    if k == 0:
        return state
    # MTP over the prompt: slot p pairs h[p] with x[p+1]; the last prompt slot pairs with the first token.
    next_tokens = jnp.concatenate([prompt_ids[:, 1:], jnp.zeros_like(prompt_ids[:, :1])], axis=1)
    next_tokens = jnp.where(jnp.arange(prompt_width) == last[:, None], first[:, None], next_tokens)
    mtp_cache = model.new_mtp_cache(batch, slots, cfg.invariant)
    _, _, mtp_cache = model.mtp_step(hidden, next_tokens, positions, mtp_cache)
    width = mtp_block_width(cfg)
    block_hidden = jnp.zeros((batch, width, hidden.shape[-1]), hidden.dtype).at[:, 0].set(last_hidden)
    return state.replace(
        mtp_cache=mtp_cache,
        mtp_hidden=block_hidden,
        mtp_tokens=jnp.zeros((batch, width), jnp.int32).at[:, 0].set(first),
        mtp_start=last,
        mtp_count=jnp.ones((batch,), jnp.int32),
        mtp_visible_from=jnp.zeros((batch,), jnp.int32) if cfg.adaptive else None,
    )


def cache_slots(prompt_width: int, cfg: DecodeConfig, shards: int = 1) -> int:
    """Cache length: prompt + budget + one verify block of overhang, rounded up to a multiple of 16; when prompt and
    budget pass one attention chunk, to whole chunks, so that attention reads only the chunks holding visible slots
    (mtp_jax.models.cache_attention), and to whole chunks on each of `shards` (M) shards of a cache split over its
    slots (mtp_jax.cache.long_cache_shards). That choice ignores k, so plain and MTP decoding of the same prompts and
    budget take the same attention path (chunks a row cannot see yet are skipped, so extra ones change nothing).
    Batch-invariant decoding (`cfg.invariant`) always reads whole chunks."""
    needed = prompt_width + cfg.max_new_tokens + cfg.num_draft + 1
    if cfg.invariant or prompt_width + cfg.max_new_tokens + 1 > ATTENTION_CHUNK:
        return -(-needed // (shards * ATTENTION_CHUNK)) * shards * ATTENTION_CHUNK
    slots = -(-needed // 16) * 16
    return slots + 16 if chunk_count(slots) else slots  # a long verify block reached whole chunks: stay one-pass


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "greedy"))
def _generate(graphdef, params, prompt_ids, prompt_lens, key, sampling, cfg: DecodeConfig, greedy: bool):
    model: CausalLM = nnx.merge(graphdef, params)
    lone = cfg.invariant and prompt_ids.shape[0] == 1
    if lone:  # batch-invariant decoding runs a lone row beside its twin (every op then sees the shapes of a batch)
        key = key if key.ndim else jax.random.split(key, 1)  # the row's own stream, as without the twin
        prompt_ids, prompt_lens, key, sampling = jax.tree.map(two_rows, (prompt_ids, prompt_lens, key, sampling))
    with activate(model.sharding_rules):  # a model on a mesh: rows over `data`, heads and vocab over `model`
        state = start_state(model, prompt_ids, prompt_lens, key, sampling, cfg, greedy)
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), round_step(model, cfg, sampling, greedy), state)
        valid = jnp.arange(cfg.max_new_tokens) < state.num_generated[:, None]
        out = GenerateOutput(
            tokens=constrain(jnp.where(valid, state.tokens[:, : cfg.max_new_tokens], 0), ("batch", None)),
            lengths=constrain(state.num_generated, ("batch",)),
            finished_by_eos=constrain(state.finished_by_eos, ("batch",)),
            stats=state.stats,
        )
        return out.first_of_twins() if lone else out


def _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling):
    cfg = cfg or DecodeConfig()
    if cfg.num_draft > 0 and not model.config.has_mtp:
        raise ValueError("num_draft > 0 needs a model with an MTP head; use num_draft=0 for plain decoding")
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


def compile_generate(model, prompt_ids, prompt_lens, key, cfg=None, sampling=None) -> CompiledGenerate:
    """Ahead-of-time compile `generate` for these shapes: returns a function of the same arguments."""
    args, static = _arguments(model, prompt_ids, prompt_lens, key, cfg, sampling)
    return CompiledGenerate(_generate.lower(*args, **static).compile())


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
    return _prefill(model, cfg, sampling, eos_ids(model, cfg), prompt_ids, prompt_lens, row_keys, slots)


def round_step(model: CausalLM, cfg: DecodeConfig, sampling, greedy: bool):
    """Traced inside jit, with the model's rules active: the loop body `generate` runs (state -> state)."""
    return _round_body(model, cfg, None if greedy else sampling, eos_ids(model, cfg))


def lower_generate(model: CausalLM, prompt_ids, prompt_lens, key, sampling, cfg: DecodeConfig, greedy: bool):
    """`generate`'s program lowered for these (possibly abstract, sharded) arguments, for inspection or compiling
    for another topology."""
    graphdef, params = nnx.split(model)
    return _generate.lower(graphdef, params, prompt_ids, prompt_lens, key, sampling, cfg=cfg, greedy=greedy)
