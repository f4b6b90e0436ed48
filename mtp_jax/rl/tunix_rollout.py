"""`MtpRollout`: a tunix rollout engine (`tunix.rl.rollout.base_rollout.BaseRollout`) that samples the policy with MTP
drafts through this project's `Engine` slots, and can keep the MTP head fresh while the policy trains.

    engine = functools.partial(MtpRollout, head="path/to/head", num_draft=3, refresh=RefreshConfig())
    cluster = rl_cluster.RLCluster(actor=policy, tokenizer=tokenizer, cluster_config=rl_cluster.ClusterConfig(
        rollout_engine=engine, ...))

tunix builds it with the rollout actor (its Llama3, Qwen2 or Qwen3 model), the tokenizer (its adapter), the rollout
mesh and config. The trunk's parameters are mapped onto a `CausalLM` (rl/tunix_models.py) and the head attached;
rejection sampling keeps every token's distribution the policy's, so tokens and log-probabilities are what tunix's
own sampler gives, in distribution: prompts tokenized and left-padded as its sampler does, completions cut before
the first EOS, log-probabilities of the sampled tokens under the tempered distribution they were drawn from.

`update_params` (tunix's weight sync after each policy step) maps the trainer's parameters again (for a LoRA
policy, tunix syncs its adapters alone, merged into the mapped trunk: rl/tunix_models.py); with `refresh`, the head
then takes `refresh_steps` optimizer steps (training/head_refresh.py) on the last rollouts under the new trunk,
before the next rollouts. The policy's parameters are never changed here.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.engine import Engine, Request
from mtp_jax.loading.heads import attach_head
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.rl.sequence_logps import compact_rows, sequence_logps
from mtp_jax.rl.tunix_models import causal_lm_from_tunix
from mtp_jax.runtime.errors import UserError
from mtp_jax.training.head_refresh import RefreshConfig, init_refresh, refresh_head, rollout_batch

ROW_WIDTH_MULTIPLE = 64  # a refresh's rows are padded to a multiple of this, so nearby widths share a program


class MtpRollout(base_rollout.BaseRollout):
    """tunix's rollout engine with MTP drafts (see the module's docstring). `head`: a head folder
    (`train_head`'s output) or a `CausalLM` holding one, for tunix's trunk; None decodes plainly. `num_draft`: drafts
    a round; `slots`: rows decoded at once; `refresh`: keep the head fresh, `refresh_steps` optimizer steps at each
    weight sync on `refresh_rows` of the last rollouts (drawn afresh each sync; None: all of them; the refresh's
    trunk pass costs in proportion); `dtype`: the rollout model's; `lora_alpha`: for a policy with qwix LoRA
    adapters, its LoraProvider's alpha (each adapter is merged scaled by alpha / its rank)."""

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh: jax.sharding.Mesh | None,
                 rollout_config: base_rollout.RolloutConfig, *, head: str | CausalLM | None = None,
                 num_draft: int = 3, slots: int = 8, refresh: RefreshConfig | None = None, refresh_steps: int = 1,
                 refresh_rows: int | None = None, dtype=jnp.float32, lora_alpha: float | None = None):  # fmt: skip
        if not isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter):  # as tunix's sampler takes them
            tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
        self._tokenizer = tokenizer
        self._eos = tuple(int(t) for t in (rollout_config.eos_tokens or [tokenizer.eos_id()]))
        self._context = max(rollout_config.kv_cache_size,
                            rollout_config.max_prompt_length + rollout_config.max_tokens_to_generate)  # fmt: skip
        self._dtype, self._mesh, self._lora_alpha = dtype, mesh, lora_alpha
        # tunix's learner syncs weights only when `model()` holds other arrays than the trainer's (colocated, tunix
        # hands over the trainer's own model): a copy of what the trainer trains (a LoRA policy's adapters, its frozen
        # trunk shared; else all of it) until the first sync, then the synced parameters.
        graphdef, adapters, rest = nnx.split(rollout_actor, nnx.LoRAParam, ...)
        if not jax.tree.leaves(adapters):
            rest = jax.tree.map(jnp.copy, rest)
        self._actor = nnx.merge(graphdef, jax.tree.map(jnp.copy, adapters), rest)
        mapped = {"dtype": dtype, "mesh": mesh, "lora_alpha": lora_alpha}
        model = causal_lm_from_tunix(rollout_actor, self._eos, self._context, **mapped)
        if isinstance(head, str):
            model = attach_head(model, head)
        elif head is not None:
            model = causal_lm_from_tunix(rollout_actor, self._eos, self._context, head=head, **mapped)
        self._model = model
        self._decode_config = DecodeConfig(num_draft=num_draft if model.config.has_mtp else 0)
        self._slots = slots
        self._engine = self._new_engine(model)
        self._refresh, self._refresh_steps, self._refresh_rows = refresh, refresh_steps, refresh_rows
        if refresh is not None and not model.config.has_mtp:
            raise UserError("refresh needs an MTP head: give MtpRollout a head")
        if refresh_rows is not None and refresh_rows < 1:
            raise UserError(f"refresh_rows must be at least 1 (or None for every rollout), got {refresh_rows}")
        self._row_draws = np.random.default_rng(0)  # which rollouts a refresh reads
        self._opt_state = init_refresh(model, refresh) if refresh is not None else None
        self._last_rollouts = None  # (tokens [B, T], lengths [B], answer starts [B]) on device: `last_rollouts`
        self._refresh_pending = False
        self.last_refresh: dict = {}  # the last refresh step's loss and per-depth accuracy
        self._key = jax.random.key(0)
        self.seconds = {"rollout": 0.0, "refresh": 0.0, "sync": 0.0}
        self.last_stats: dict = {}  # the last generate's decode counters (drafted, accepted, emitted, ...)

    def _new_engine(self, model: CausalLM) -> Engine:
        """Slots decoding `model` (its programs compiled once: a new engine of the same shapes reuses them)."""
        return Engine(model, self._decode_config, slots=self._slots, max_len=self._context)

    @property
    def decode_model(self) -> CausalLM:
        """The `CausalLM` rollouts decode with: tunix's trunk as of the last sync, and the (refreshed) head."""
        return self._model

    # ---- generation ----

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs) -> (
            base_rollout.RolloutOutput):  # fmt: skip
        if tuple(rollout_config.eos_tokens or [self._tokenizer.eos_id()]) != self._eos:
            raise UserError(f"this engine stops at EOS ids {self._eos}; the rollout config asks for others")
        if self._refresh_pending:
            self._refresh_head()
        if self._engine is None:
            self._engine = self._new_engine(self._model)
        start = time.perf_counter()
        ids = [self._tokenize(p) for p in prompts]
        budget = rollout_config.max_tokens_to_generate
        if max(len(x) for x in ids) + budget > self._context:
            raise UserError(f"a prompt of {max(len(x) for x in ids)} tokens and {budget} new ones exceed the "
                            f"engine's {self._context} positions (the rollout config's kv_cache_size)")  # fmt: skip
        keys = self._request_keys(rollout_config.seed, len(ids))
        before = self._engine.stats()
        answers = self._decode(ids, rollout_config, keys)
        self.last_stats = {k: np.subtract(v, before[k]).tolist() for k, v in self._engine.stats().items()}
        padded = left_padded(ids, rollout_config.max_prompt_length, self._tokenizer.pad_id())
        logprobs = None
        if rollout_config.return_logprobs:
            logprobs = self._sampled_logprobs(padded, answers, rollout_config.temperature)
        self._last_rollouts = rollout_rows(ids, answers)
        self.seconds["rollout"] += time.perf_counter() - start
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(a.tolist()) for a in answers],
            logits=[],
            tokens=answers,
            left_padded_prompt_tokens=padded,
            logprobs=logprobs,
        )

    def _tokenize(self, prompt: str) -> list[int]:
        """As tunix's sampler does: BOS (when the tokenizer has one) + the encoded text, a doubled BOS dropped."""
        bos = [self._tokenizer.bos_id()] if self._tokenizer.bos_id() else []
        return [int(t) for t in self._tokenizer.dedup_bos_ids(bos + list(self._tokenizer.encode(prompt)))]

    def _request_keys(self, seed, count: int) -> list[jax.Array]:
        """A key a prompt: from the rollout config's seed (an int, a typed key or a raw uint32 key), else from this
        engine's own stream, which moves on each call."""
        if seed is None:
            self._key, base = jax.random.split(self._key)
        elif jnp.issubdtype(jnp.asarray(seed).dtype, jax.dtypes.prng_key):
            base = seed
        elif jnp.ndim(seed):
            base = jax.random.wrap_key_data(jnp.asarray(seed, jnp.uint32))
        else:
            base = jax.random.key(int(seed))
        return [jax.random.fold_in(base, i) for i in range(count)]

    def _decode(self, ids: list[list[int]], cfg: base_rollout.RolloutConfig, keys) -> list[np.ndarray]:
        """Each prompt's answer through the engine's slots, cut before its first EOS."""
        temperature = float(cfg.temperature or 0.0)
        order = {}
        for i, (prompt, key) in enumerate(zip(ids, keys, strict=True)):
            request = Request(prompt_ids=prompt, max_tokens=cfg.max_tokens_to_generate, temperature=temperature,
                              top_k=int(cfg.top_k or 0), top_p=float(cfg.top_p or 1.0), key=key)  # fmt: skip
            order[self._engine.submit(request)] = i
        answers: list[list[int]] = [[] for _ in ids]
        while self._engine.busy:
            for update in self._engine.step():
                answers[order[update.request_id]].extend(update.tokens)
        return [np.asarray(cut_at_eos(a, self._eos), np.int32) for a in answers]

    def _sampled_logprobs(self, padded: np.ndarray, answers: list[np.ndarray], temperature: float) -> list[list[float]]:
        length = max(1, max(len(a) for a in answers))
        completions = np.full((len(answers), length), self._tokenizer.pad_id(), np.int32)
        for row, answer in enumerate(answers):
            completions[row, : len(answer)] = answer
        logps = np.asarray(self._logps(jnp.asarray(padded), jnp.asarray(completions), temperature or 0.0))
        return [logps[row, : len(answer)].tolist() for row, answer in enumerate(answers)]

    # ---- what tunix's learner asks of the rollout policy ----

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array,
                            completion_mask: jax.Array | None = None) -> jax.Array:  # fmt: skip
        """log p(completion token | prompt and the completion before it) [B, G] under the policy (untempered),
        prompts [B, P] left-padded and completions [B, G] right-padded with the pad id, as tunix passes them."""
        return self._logps(prompt_tokens, completion_tokens, 1.0)

    def _logps(self, prompt_tokens, completion_tokens, temperature: float) -> jax.Array:
        rows, starts = compact_rows(prompt_tokens, completion_tokens, self._tokenizer.pad_id())
        return sequence_logps(self._model, rows, starts, completion_tokens.shape[1], temperature)

    def update_params(self, params, filter_types=None) -> None:
        """Take the trainer's parameters (tunix's nnx state of the actor, all of them or the `filter_types` ones:
        nnx.Param, or nnx.LoRAParam for a LoRA policy's adapters): the trunk is mapped again, adapters merged, and,
        with `refresh`, the head takes its refresh steps under it."""
        if filter_types is not None and any(t not in (nnx.Param, nnx.LoRAParam) for t in filter_types):
            raise UserError(f"MtpRollout syncs parameters (nnx.Param) or LoRA adapters (nnx.LoRAParam), not "
                            f"{filter_types}")  # fmt: skip
        start = time.perf_counter()
        graphdef, state = nnx.split(self._actor)
        actor = nnx.merge(graphdef, state)  # new Variables: the trainer's own model is not touched
        nnx.update(actor, params)
        self._actor = actor
        head = self._model if self._model.config.has_mtp else None
        model = causal_lm_from_tunix(actor, self._eos, self._context, self._dtype, head=head, mesh=self._mesh,
                                     lora_alpha=self._lora_alpha)  # fmt: skip
        self._model, self._engine = model, None  # the slots are rebuilt at the next generate
        self._refresh_pending = self._refresh is not None and self._last_rollouts is not None
        self.seconds["sync"] += time.perf_counter() - start

    def _refresh_head(self) -> None:
        """The head's refresh steps on the last rollouts under the current trunk. Run at the next `generate`, as is
        the slots' rebuild: tunix syncs weights where no host transfer is allowed, and both place host values."""
        start = time.perf_counter()
        model = self._model
        batch = rollout_batch(model, *sample_rows(self._last_rollouts, self._refresh_rows, self._row_draws))
        for _ in range(self._refresh_steps):
            model, self._opt_state, metrics = refresh_head(model, self._opt_state, batch, self._refresh)
        self.last_refresh = {"loss": float(metrics["loss"]), "acc": np.asarray(metrics["acc"]).tolist()}
        self._model, self._refresh_pending = model, False
        self.seconds["refresh"] += time.perf_counter() - start

    @property
    def last_rollouts(self) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """The last `generate`'s rollouts on device, as a refresh reads them (`rollout_rows`); None before any."""
        return self._last_rollouts

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self) -> nnx.Module:
        """The policy as of the last sync, in tunix's own model (what tunix's learner and offloading read); the
        engine decodes with `decode_model`."""
        return self._actor


def cut_at_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """`tokens` up to (not including) the first EOS id."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def left_padded(ids: list[list[int]], width: int, pad_id: int) -> np.ndarray:
    """Prompts [B, W] left-padded to `width`, or to the next power of two of the longest when it is longer (as
    tunix's sampler pads them)."""
    longest = max(len(x) for x in ids)
    if longest > width:
        width = 1 << (longest - 1).bit_length()
    out = np.full((len(ids), width), pad_id, np.int32)
    for row, x in enumerate(ids):
        out[row, width - len(x) :] = x
    return out


def rollout_rows(ids: list[list[int]], answers: list[np.ndarray]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(prompt + answer right-padded [B, T], lengths [B], where each answer starts [B]) on device: what a head
    refresh reads of the rollouts."""
    lengths = [len(p) + len(a) for p, a in zip(ids, answers, strict=True)]
    width = -(-max(lengths) // ROW_WIDTH_MULTIPLE) * ROW_WIDTH_MULTIPLE
    rows = np.zeros((len(ids), width), np.int32)
    for row, (prompt, answer) in enumerate(zip(ids, answers, strict=True)):
        rows[row, : lengths[row]] = [*prompt, *answer]
    return jnp.asarray(rows), jnp.asarray(lengths, jnp.int32), jnp.asarray([len(p) for p in ids], jnp.int32)


def sample_rows(rollouts: tuple[jax.Array, jax.Array, jax.Array], count: int | None, draws: np.random.Generator):
    """`count` of the rollouts' rows (`rollout_rows`) drawn by `draws` without replacement, cut to their own width (a
    multiple of ROW_WIDTH_MULTIPLE); all of them when `count` is None or at least their number."""
    total = rollouts[0].shape[0]
    if count is None or count >= total:
        return rollouts
    rows = jnp.asarray(np.sort(draws.choice(total, count, replace=False)))
    tokens, lengths, starts = (jnp.take(x, rows, axis=0) for x in rollouts)
    width = -(-int(jnp.max(lengths)) // ROW_WIDTH_MULTIPLE) * ROW_WIDTH_MULTIPLE
    return tokens[:, :width], lengths, starts
