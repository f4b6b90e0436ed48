"""The decode loop's state: what one round reads and the next round gets, with its MTP block and adaptive parts as
named sub-states.

Sequence bookkeeping for a row (n = `position`, the slot of the pending token):
  the trunk cache is valid for slots < n; the pending token x_n is generated but not yet run through the trunk;
  the MTP cache is valid for slots < `block.start`; the MTP block holds the trunk hiddens h[start + j] with their
  next tokens x[start + j + 1] for j < `block.count`, where start + count = n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.adaptive import AcceptanceTracker, RestSchedule, probe_cycle
from mtp_jax.models.kv_cache import KVCache


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
    rests: jax.Array  # [] loop iterations that skipped the MTP layer of a drafting loop (counted in rounds_with[0])
    tree_rounds: jax.Array  # [] loop iterations that verified a draft tree (counted in rounds_with[k])

    @classmethod
    def zeros(cls, max_draft: int) -> DecodeStats:
        scalar = jnp.int32(0)
        return cls(
            rounds=scalar,
            row_rounds=scalar,
            emitted=scalar,
            drafted=scalar,
            accepted=scalar,
            reached=jnp.zeros((max_draft,), jnp.int32),
            accepted_at=jnp.zeros((max_draft,), jnp.int32),
            rounds_with=jnp.zeros((max_draft + 1,), jnp.int32),
            rests=scalar,
            tree_rounds=scalar,
        )


def mtp_block_width(cfg: DecodeConfig) -> int:
    """Slots W of the MTP block: the k + 1 a round can accept, and REST_ROUNDS more for adaptive decoding's rests."""
    return probe_cycle(cfg.num_draft) if cfg.adaptive and cfg.num_draft > 0 else cfg.num_draft + 1


def keep_active(active: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """`new` [B, ...] in the rows `active` [B] marks, `old` in the others."""
    return jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)


@struct.dataclass
class MtpBlock:
    """The trunk hiddens and next tokens the MTP layer has not yet run over (its cache waits for the next catch-up):
    slot j of a row holds h[start + j] and x[start + j + 1], for j < count."""

    hidden: jax.Array  # [B, W, D], W = mtp_block_width(cfg)
    tokens: jax.Array  # [B, W]
    start: jax.Array  # [B] position of slot 0
    count: jax.Array  # [B] valid slots
    visible_from: jax.Array | None  # [B] adaptive decoding: MTP cache slots before it are stale (skipped)

    @property
    def width(self) -> int:
        return self.hidden.shape[1]

    def verified(self, active, position, accepted, hidden, emitted) -> MtpBlock:
        """After a round through the MTP layer: the verify pass's hiddens [B, j+1, D] at `position` [B] and the
        tokens it emitted [B, j+1], `accepted` + 1 of them valid; rows not `active` [B] keep theirs."""
        widen = lambda x: jnp.pad(x, [(0, 0), (0, self.width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))  # -> [B, W]
        return self.replace(
            hidden=keep_active(active, widen(hidden), self.hidden),
            tokens=keep_active(active, widen(emitted), self.tokens),
            start=keep_active(active, position, self.start),
            count=keep_active(active, accepted + 1, self.count),
        )

    def queued(self, grow: jax.Array, slide: jax.Array, hidden: jax.Array, token: jax.Array) -> MtpBlock:
        """A rest's (h[n] [B, D], x[n+1] [B]) into the block: into its next slot where it has room (`grow` [B]);
        where it is full (`slide` [B]) the block slides, dropping its oldest entry: the MTP cache will skip that
        position, so the MTP layer attends to none of its cache before the block's new start."""
        append = grow[:, None] & (jnp.arange(self.width) == self.count[:, None])  # [B, W]
        slid_hidden = jnp.concatenate([self.hidden[:, 1:], hidden[:, None]], axis=1)  # [B, W, D]
        slid_tokens = jnp.concatenate([self.tokens[:, 1:], token[:, None]], axis=1)  # [B, W]
        start = jnp.where(slide, self.start + 1, self.start)
        return MtpBlock(
            hidden=jnp.where(slide[:, None, None], slid_hidden, jnp.where(append[..., None], hidden[:, None],
                                                                          self.hidden)),
            tokens=jnp.where(slide[:, None], slid_tokens, jnp.where(append, token[:, None], self.tokens)),
            start=start,
            count=jnp.where(grow, self.count + 1, self.count),
            visible_from=jnp.where(slide, start, self.visible_from),
        )  # fmt: skip


@struct.dataclass
class AdaptiveState:
    """Adaptive decoding's running state: the acceptance estimate and when a resting loop probes next."""

    tracker: AcceptanceTracker
    schedule: RestSchedule

    @classmethod
    def start(cls, max_draft: int) -> AdaptiveState:
        return cls(tracker=AcceptanceTracker.start(max_draft), schedule=RestSchedule.start())


@struct.dataclass
class LoopState:
    """The carry of the decode loop (see the module's docstring for what its positions mean)."""

    tokens: jax.Array  # [B, max_new_tokens + k + 1] output buffer
    num_generated: jax.Array  # [B] tokens in `tokens` (the pending token included)
    done: jax.Array  # [B] bool
    finished_by_eos: jax.Array  # [B] bool
    position: jax.Array  # [B] slot of the pending token
    pending: jax.Array  # [B] last generated token, not yet in the trunk cache
    cache: tuple  # trunk, one per segment: KVCache [L, B, S, K, H], LatentCache, or GroupCache (hybrid groups)
    mtp_cache: KVCache | None  # [1, B, S, K, H]; None in plain decoding (k = 0)
    block: MtpBlock | None  # None in plain decoding
    row_keys: jax.Array  # [B] one random stream per row
    stats: DecodeStats
    adaptive: AdaptiveState | None  # adaptive decoding only
    budget: jax.Array  # [B] the most tokens a row may generate (cfg.max_new_tokens, or a request's own)


def round_keys(row_keys: jax.Array, round_index: jax.Array, purpose: int) -> jax.Array:
    """A fresh key per row for this round and purpose: [B] keys. `round_index` [B] (or one for every row) names the
    round in the row's own count, its tokens so far (`num_generated`, which every round raises): a row's draws then
    depend on its key alone, not on the batch or the slot it decodes in, nor on when it joined."""
    index = jnp.broadcast_to(round_index, row_keys.shape)
    return jax.vmap(lambda k, i: jax.random.fold_in(jax.random.fold_in(k, i), purpose))(row_keys, index)


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...], index [B] -> x[b, index[b]] : [B, ...]."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
