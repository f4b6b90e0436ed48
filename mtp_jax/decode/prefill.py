"""The decode loop's prefill: the trunk (and the MTP layer) over the padded prompts, and the loop state the first
round starts from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.loop_state import (
    AdaptiveState,
    DecodeStats,
    LoopState,
    MtpBlock,
    gather_rows,
    mtp_block_width,
    round_keys,
)
from mtp_jax.decode.sampling import SamplingParams, first_argmax, probabilities, sample
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.kv_cache import KVCache, decode_attention


@struct.dataclass
class PromptPart:
    """The caches over the first `start` tokens of long prompts, prefilled a chunk at a time (`prefill_part`), for
    `prefill` to finish."""

    start: jax.Array  # [B] tokens the caches hold
    cache: tuple  # the trunk's, per segment
    mtp_cache: KVCache | None  # None without MTP

    @classmethod
    def empty(cls, model: CausalLM, cfg: DecodeConfig, batch: int, slots: int, attention: str) -> PromptPart:
        mtp_cache = model.new_mtp_cache(batch, slots, attention) if cfg.num_draft else None
        return cls(jnp.zeros((batch,), jnp.int32), model.new_cache(batch, slots, attention), mtp_cache)


def prefill_part(model: CausalLM, cfg: DecodeConfig, ids: jax.Array, following: jax.Array, part: PromptPart):
    """`part` extended over the next whole chunk of its prompts (ids [B, C]; following [B]: each prompt's token
    after the chunk, which the MTP layer pairs with the chunk's last hidden)."""
    positions = part.start[:, None] + jnp.arange(ids.shape[1])  # [B, C]
    if not cfg.num_draft:
        _, cache = model.trunk(ids, positions, part.cache)
        return PromptPart(part.start + ids.shape[1], cache, part.mtp_cache)
    _, draft_hidden, cache = model.trunk_for_drafts(ids, positions, part.cache)  # [B, C, D]
    next_tokens = jnp.concatenate([ids[:, 1:], following[:, None]], axis=1)  # [B, C]
    _, _, mtp_cache = model.mtp_step(draft_hidden, next_tokens, positions, part.mtp_cache)
    return PromptPart(part.start + ids.shape[1], cache, mtp_cache)


def prefill(model: CausalLM, cfg: DecodeConfig, sampling: SamplingParams | None, eos: jax.Array,
            prompt_ids: jax.Array, prompt_lens: jax.Array, row_keys: jax.Array, slots: int,
            budget: jax.Array | None = None, attention: str | None = None,
            part: PromptPart | None = None) -> LoopState:  # fmt: skip
    """Trunk (and MTP) over the padded prompts (ids [B, P], lens [B], one key per row [B], caches of `slots`); the
    first token from each row's last prompt position (sampled unless `sampling` is None); `eos` [E] ends a row.
    `budget` [B]: each row's most tokens (cfg.max_new_tokens when None, at most that); `attention`: the caches' form
    (`decode_attention` of the prompt width when None). `part`: the caches over the prompts' earlier tokens (the
    ids are then their last chunk, from position `part.start` on); None: the ids are the whole prompts."""
    batch, prompt_width = prompt_ids.shape
    k = cfg.num_draft
    budget = jnp.full((batch,), cfg.max_new_tokens, jnp.int32) if budget is None else budget
    attention = attention or decode_attention(prompt_width, cfg)
    part = part or PromptPart.empty(model, cfg, batch, slots, attention)
    positions = part.start[:, None] + jnp.arange(prompt_width)  # [B, P]
    if k:  # the MTP layer reads the draft hidden (the final one, or its fusion with earlier layers' outputs)
        hidden, draft_hidden, cache = model.trunk_for_drafts(prompt_ids, positions, part.cache, prompt_lens)
    else:
        (hidden, cache), draft_hidden = model.trunk(prompt_ids, positions, part.cache, lengths=prompt_lens), None
    last = prompt_lens - 1  # each row's last prompt token, in the ids
    logits = model.logits(gather_rows(hidden, last))  # [B, V]
    if sampling is None:
        first = first_argmax(logits)
    else:
        keys = round_keys(row_keys, jnp.int32(-1), 0)
        first = jax.vmap(sample)(keys, probabilities(logits[:, None], sampling)[:, 0])
    tokens = jnp.zeros((batch, cfg.max_new_tokens + k + 1), jnp.int32).at[:, 0].set(first)
    hit_eos = jnp.isin(first, eos)
    stats = DecodeStats.zeros(k)
    state = LoopState(
        tokens=tokens,
        num_generated=jnp.ones((batch,), jnp.int32),
        done=hit_eos | (budget <= 1),
        finished_by_eos=hit_eos,
        position=part.start + prompt_lens,
        pending=first,
        cache=cache,
        mtp_cache=None,
        block=None,
        row_keys=row_keys,
        stats=stats,
        adaptive=AdaptiveState.start(k) if cfg.adaptive and k > 0 else None,
        budget=budget,
    )
    if k == 0:
        return state
    mtp_cache = mtp_over_prompt(model, prompt_ids, positions, last, draft_hidden, first, part.mtp_cache)
    block = first_block(cfg, gather_rows(draft_hidden, last), first, part.start + last)
    return state.replace(mtp_cache=mtp_cache, block=block)


def mtp_over_prompt(model: CausalLM, prompt_ids, positions, last, hidden, first, mtp_cache):
    """The MTP cache over the prompts (ids and positions [B, P], hidden [B, P, D]): slot p pairs h[p] with x[p+1];
    each row's last prompt token (last [B], its index in the ids) pairs with its first token (first [B])."""
    prompt_width = prompt_ids.shape[1]
    next_tokens = jnp.concatenate([prompt_ids[:, 1:], jnp.zeros_like(prompt_ids[:, :1])], axis=1)
    next_tokens = jnp.where(jnp.arange(prompt_width) == last[:, None], first[:, None], next_tokens)
    _, _, mtp_cache = model.mtp_step(hidden, next_tokens, positions, mtp_cache)
    return mtp_cache


def first_block(cfg: DecodeConfig, last_hidden: jax.Array, first: jax.Array, last: jax.Array) -> MtpBlock:
    """The MTP block after the prefill: one slot, h[P-1] (last_hidden [B, D]) with the first token (first [B]),
    at each row's last prompt position (last [B])."""
    batch, width = first.shape[0], mtp_block_width(cfg)
    return MtpBlock(
        hidden=jnp.zeros((batch, width, last_hidden.shape[-1]), last_hidden.dtype).at[:, 0].set(last_hidden),
        tokens=jnp.zeros((batch, width), jnp.int32).at[:, 0].set(first),
        start=last,
        count=jnp.ones((batch,), jnp.int32),
        visible_from=jnp.zeros((batch,), jnp.int32) if cfg.adaptive else None,
    )
