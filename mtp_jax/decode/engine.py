"""`Engine`: decoding with slots that refill. B rows of fixed-shape loop state stay on device; requests wait in a
queue, take a free slot through one jitted insert (their prefill, bucketed by prompt width and by how many join at
once), and the draft/verify rounds of `generate` run over all slots until a row finishes or a few rounds pass, so a
finished row's slot is refilled at once instead of idling until the longest row of a static batch is done.

A row's tokens are those of the same prompt decoded alone by `generate` with the same key and settings: its caches,
MTP block and random stream are its own from its insert on (`round_keys` counts a row's own rounds), and every kind
of round is lossless. Under batch-invariant decoding (`DecodeConfig.invariant`) greedy tokens are equal bit for bit;
otherwise they are as equal as `generate`'s at different batch sizes are.

    engine = Engine(model, DecodeConfig(num_draft=3), slots=8, max_len=1024)
    rid = engine.submit(Request(prompt_ids=(1, 2, 3), max_tokens=64))
    while engine.busy:
        for update in engine.step():  # new tokens of each running request; `finished` once its row is done
            ...
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode import memory
from mtp_jax.decode import stats as decode_stats
from mtp_jax.decode.prefill import PromptPart
from mtp_jax.decode.prompts import bucket
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.slot_programs import SlotLayout, empty_part, empty_slots, extend_part, insert_rows, run_rounds
from mtp_jax.decode.speculative import checked_decode_config
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.kv_cache import cache_slots, decode_attention, long_cache_shards
from mtp_jax.parallel.sharding import to_host

ROUNDS_PER_PIECE = 8  # the most rounds between two looks at the queue (and two streamed updates)
PREFILL_CHUNK = 256  # prompts longer than this are prefilled this many tokens a step, between pieces of rounds


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to decode: its ids, its budget and its own sampling settings and random stream."""

    prompt_ids: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # the stream is key(seed) unless `key` is given
    key: jax.Array | None = None  # a typed key (jax.random.key)


@dataclasses.dataclass(frozen=True)
class Update:
    """What a step did for one request: its tokens generated since the last update, and whether it is finished."""

    request_id: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None  # when finished: "eos", "length" (its max_tokens) or "cancelled"


@dataclasses.dataclass
class _Staged:
    """A long prompt being prefilled a chunk a step into the slot reserved for it."""

    request_id: int
    request: Request
    slot: int
    part: PromptPart  # the caches over its first `prefilled` tokens (rows: the engine's insert unit)
    prefilled: int = 0


@dataclasses.dataclass
class _Running:
    request_id: int
    request: Request
    sent: int = 0  # tokens handed out in updates


class Engine:
    """Decoding with `slots` rows that refill (see the module's docstring). `max_len`: the most positions a row
    holds, prompt and generated tokens together (default: the model's context, at most 4096); `cfg.max_new_tokens`
    is unused (each request brings its budget). Not thread-safe: one thread submits, cancels and steps."""

    def __init__(self, model: CausalLM, cfg: DecodeConfig | None = None, *, slots: int = 8, max_len: int | None = None,
                 rounds_per_piece: int = ROUNDS_PER_PIECE, prefill_chunk: int | None = PREFILL_CHUNK):  # fmt: skip
        cfg = checked_decode_config(model, cfg or DecodeConfig())
        context = model.config.max_position_embeddings
        max_len = min(context, 4096) if max_len is None else max_len
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 2 <= max_len <= context:
            raise ValueError(f"max_len must be an integer in [2, {context}] (the model's context), got {max_len!r}")
        if rounds_per_piece < 1:
            raise ValueError(f"rounds_per_piece must be >= 1, got {rounds_per_piece}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):  # fmt: skip
            raise ValueError(f"prefill_chunk must be an integer >= 1 or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        shards = 1 if model.sharding_rules is None else model.sharding_rules.axis_size("batch")
        if cfg.invariant:  # a lone row would be summed otherwise than a row of a batch (speculative._lone)
            slots = max(slots, 2)
        self.slots = -(-slots // shards) * shards
        self._insert_unit = math.lcm(shards, 2 if cfg.invariant else 1)  # insert batches: multiples of it
        self.cfg = dataclasses.replace(cfg, max_new_tokens=max_len)
        self.max_len = max_len
        self._rounds_per_piece = rounds_per_piece
        self._model = model
        self._graphdef, self._params = nnx.split(model)
        self._layout = SlotLayout(
            self.slots,
            cache_slots(0, self.cfg, long_cache_shards(model.config, model.sharding_rules)),
            decode_attention(0, self.cfg),
        )
        build = functools.partial(empty_slots, self._graphdef, cfg=self.cfg, layout=self._layout)
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(build, self._params)))
        short = memory.shortfall(model, state_bytes, "the slots' caches and state")
        if short is not None:
            raise ValueError(f"{self.slots} slots of {max_len} positions: {short}")
        self._state = build(self._params)
        self._sampling = SamplingParams.from_config(self.cfg, self.slots)
        self._running: list[_Running | None] = [None] * self.slots
        self._released = np.zeros((self.slots,), bool)
        self._staged: _Staged | None = None
        self._reserved: set[int] = set()  # the staged prompt's slot
        self._waiting: collections.deque[tuple[int, Request]] = collections.deque()
        self._next_id = 0
        self.seconds = {"insert": 0.0, "rounds": 0.0}  # host time in inserts (chunks included) and in rounds
        self.chunks_prefilled = 0  # long prompts' chunks before their last

    # ---- the queue ----

    def submit(self, request: Request) -> int:
        """Queue a request (checked here, in one line); its id."""
        self.check(request)
        request_id, self._next_id = self._next_id, self._next_id + 1
        self._waiting.append((request_id, request))
        return request_id

    def check(self, request: Request) -> None:
        """Refuse a request the slots cannot hold or the model cannot read."""
        ids, vocab = list(request.prompt_ids), self._model.config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {request.max_tokens!r}")
        if len(ids) + request.max_tokens > self.max_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) and max_tokens ({request.max_tokens}) take "
                             f"{len(ids) + request.max_tokens} positions; a slot holds {self.max_len}")  # fmt: skip
        if request.temperature < 0 or not 0 < request.top_p <= 1 or request.top_k < 0:
            raise ValueError("temperature must be >= 0, top_p in (0, 1] and top_k >= 0")

    def cancel(self, request_id: int) -> bool:
        """End a request: dropped from the queue (or from its chunked prefill), or its row released at the next step
        (its last update says "cancelled"). False when it is not (or no longer) there."""
        for i, (waiting_id, _) in enumerate(self._waiting):
            if waiting_id == request_id:
                del self._waiting[i]
                return True
        if self._staged is not None and self._staged.request_id == request_id:
            self._reserved.discard(self._staged.slot)
            self._staged = None
            return True
        for slot, running in enumerate(self._running):
            if running is not None and running.request_id == request_id:
                self._released[slot] = True
                return True
        return False

    @property
    def busy(self) -> bool:
        """Whether a request waits or runs."""
        return bool(self._waiting) or self._staged is not None or any(r is not None for r in self._running)

    @property
    def waiting(self) -> int:
        """Requests without a row yet: queued, or a long prompt being prefilled."""
        return len(self._waiting) + (self._staged is not None)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self._running)

    # ---- a step ----

    def step(self) -> list[Update]:
        """Admit waiting requests into free slots, run a piece of rounds, and say what each request got."""
        updates = self._release()
        self._admit()
        if not any(r is not None for r in self._running):
            return updates
        greedy = all(r is None or r.request.temperature == 0 for r in self._running)
        start = time.perf_counter()
        self._state, view = run_rounds(self._graphdef, self._params, self._state, self._sampling,
                                       jnp.int32(self._rounds_per_piece), cfg=self.cfg, greedy=greedy)  # fmt: skip
        tokens, lengths, done, by_eos = (to_host(x) for x in (view.tokens, view.num_generated, view.done,
                                                              view.finished_by_eos))  # fmt: skip
        self.seconds["rounds"] += time.perf_counter() - start
        for slot, running in enumerate(self._running):
            if running is None:
                continue
            new = tokens[slot, running.sent : lengths[slot]].tolist()
            running.sent = int(lengths[slot])
            reason = ("eos" if by_eos[slot] else "length") if done[slot] else None
            if done[slot]:
                self._running[slot] = None
            if new or reason:
                updates.append(Update(running.request_id, new, reason is not None, reason))
        return updates

    def _release(self) -> list[Update]:
        """Free the slots of cancelled requests: their rows end before the next insert and piece of rounds."""
        updates = []
        for slot in np.flatnonzero(self._released):
            running = self._running[slot]
            updates.append(Update(running.request_id, [], True, "cancelled"))
            self._running[slot] = None
        if updates:
            done = self._state.done | jnp.asarray(self._released)
            self._state = self._state.replace(done=done)
        self._released[:] = False
        return updates

    def _admit(self) -> None:
        """Move the long prompt being prefilled on by a chunk (into its slot when it is the last), and prefill as
        many short waiting requests as there are free slots, in one insert; a long one starts its chunks when no
        other is being prefilled."""
        if self._staged is not None:
            self._advance_staged()
        free = [slot for slot, running in enumerate(self._running) if running is None and slot not in self._reserved]
        joining, skipped = [], collections.deque()
        while self._waiting and len(joining) < len(free):
            request_id, request = self._waiting.popleft()
            if not self._is_long(request):
                joining.append((request_id, request))
            elif self._staged is None:
                self._start_staged(request_id, request, free.pop())
            else:
                skipped.append((request_id, request))
        self._waiting.extendleft(reversed(skipped))
        if joining:
            self._insert(joining, free[: len(joining)])

    def _is_long(self, request: Request) -> bool:
        return self.prefill_chunk is not None and len(request.prompt_ids) > self.prefill_chunk

    def _insert(self, joining: list[tuple[int, Request]], slots: list[int], part=None) -> None:
        """One insert of the `joining` requests into `slots` (with `part`: the last chunk of one long prompt, whose
        earlier chunks `part` holds)."""
        rows = self._insert_rows(len(joining))
        offset = 0 if part is None else self._staged.prefilled
        width = min(bucket(max(len(r.prompt_ids) - offset for _, r in joining)), self.max_len - offset)
        ids = np.zeros((rows, width), np.int32)
        lens = np.ones((rows,), np.int32)
        where = np.full((rows,), self.slots, np.int32)  # padding rows land past the last slot: dropped
        for row, ((request_id, request), slot) in enumerate(zip(joining, slots, strict=True)):
            ids[row, : len(request.prompt_ids) - offset] = request.prompt_ids[offset:]
            lens[row], where[row] = len(request.prompt_ids) - offset, slot
            self._running[slot] = _Running(request_id, request)
        if part is not None:  # the padding rows decode the same prompt, dropped as well
            ids[1:], lens[1:] = ids[0], lens[0]
        requests = [r for _, r in joining] + [joining[0][1]] * (rows - len(joining))
        self._run_insert(ids, lens, requests, where, part)

    def _run_insert(self, ids: np.ndarray, lens: np.ndarray, requests: list[Request], where: np.ndarray,
                    part: PromptPart | None) -> None:  # fmt: skip
        """Prefill `ids` [n, P] (lens [n]; `requests` [n]: their settings) into slots `where` [n]."""
        keys = jnp.stack([r.key if r.key is not None else jax.random.key(r.seed) for r in requests])
        sampling = SamplingParams(
            temperature=jnp.asarray([r.temperature for r in requests], jnp.float32),
            top_k=jnp.asarray([r.top_k for r in requests], jnp.int32),
            top_p=jnp.asarray([r.top_p for r in requests], jnp.float32),
        )
        budget = jnp.asarray([r.max_tokens for r in requests], jnp.int32)
        greedy = all(r.temperature == 0 for r in requests)
        start = time.perf_counter()
        self._state, self._sampling = insert_rows(
            self._graphdef, self._params, self._state, self._sampling, jnp.asarray(ids), jnp.asarray(lens), keys,
            sampling, budget, jnp.asarray(where), part, cfg=self.cfg, layout=self._layout, greedy=greedy,
        )  # fmt: skip
        self.seconds["insert"] += time.perf_counter() - start

    def _start_staged(self, request_id: int, request: Request, slot: int) -> None:
        """Reserve `slot` for a long prompt and prefill its first chunk."""
        part = empty_part(self._graphdef, self._params, cfg=self.cfg, layout=self._layout, rows=self._insert_unit)
        self._reserved.add(slot)
        self._staged = _Staged(request_id, request, slot, part)
        self._advance_staged()

    def _advance_staged(self) -> None:
        """The long prompt's next chunk: into its caches, or, the last, into its slot."""
        staged, chunk = self._staged, self.prefill_chunk
        ids = staged.request.prompt_ids
        start = time.perf_counter()
        if len(ids) - staged.prefilled > chunk:
            piece = np.asarray(ids[staged.prefilled : staged.prefilled + chunk + 1], np.int32)  # + the token after
            rows = np.broadcast_to(piece, (self._insert_unit, chunk + 1))
            staged.part = extend_part(self._graphdef, self._params, staged.part, jnp.asarray(rows[:, :chunk]),
                                      jnp.asarray(rows[:, chunk]), cfg=self.cfg)  # fmt: skip
            staged.prefilled += chunk
            self.chunks_prefilled += 1
            self.seconds["insert"] += time.perf_counter() - start
            return
        self._insert([(staged.request_id, staged.request)], [staged.slot], staged.part)
        self._reserved.discard(staged.slot)
        self._staged = None

    # ---- compiling ahead ----

    def warm(self, max_prompt: int | None = None, sampled: bool = False) -> int:
        """Compile now the programs requests will run, so that none compiles inside a request's latency: the insert
        of every bucket (rows joining at once x prompt width, for prompts up to `max_prompt` tokens; default: the
        prefill chunk, or the slot's positions when prompts are not chunked), long prompts' chunks and last chunk,
        and the rounds; for greedy requests, and with `sampled` for sampled ones too. Each insert runs once on rows
        that are dropped (every row of it lands past the last slot), so the slots, running or not, are unchanged.
        Returns how many programs ran."""
        short = self.max_len - 1 if self.prefill_chunk is None else min(self.prefill_chunk, self.max_len - 1)
        longest = short if max_prompt is None else max(1, min(max_prompt, short))
        widths = sorted({min(bucket(n), self.max_len) for n in _bucket_edges(longest)})
        row_counts = sorted({self._insert_rows(n) for n in range(1, self.slots + 1)})
        modes = (True, False) if sampled else (True,)
        seconds = dict(self.seconds)
        for greedy in modes:
            for rows, width in ((r, w) for r in row_counts for w in widths):
                self._insert_dropped(rows, width, greedy)
            self._state, _ = run_rounds(self._graphdef, self._params, self._state, self._sampling, jnp.int32(0),
                                        cfg=self.cfg, greedy=greedy)  # fmt: skip
        programs = len(modes) * (len(row_counts) * len(widths) + 1)
        if short < self.max_len - 1 and (max_prompt is None or max_prompt > short):  # long prompts, in chunks
            chunk, unit = self.prefill_chunk, self._insert_unit
            part = empty_part(self._graphdef, self._params, cfg=self.cfg, layout=self._layout, rows=unit)
            part = extend_part(self._graphdef, self._params, part, jnp.asarray(np.zeros((unit, chunk), np.int32)),
                               jnp.asarray(np.zeros((unit,), np.int32)), cfg=self.cfg)  # fmt: skip
            last = sorted({min(bucket(n), self.max_len - offset)  # a last chunk's widths, after each offset
                           for offset in range(chunk, self.max_len - 1, chunk)
                           for n in _bucket_edges(min(chunk, self.max_len - 1 - offset))})  # fmt: skip
            for greedy in modes:
                for width in last:
                    self._insert_dropped(self._insert_unit, width, greedy, part)
            programs += 2 + len(modes) * len(last)
        jax.block_until_ready(self._state)
        self.seconds = seconds
        return programs

    def _insert_dropped(self, rows: int, width: int, greedy: bool, part: PromptPart | None = None) -> None:
        """An insert of `rows` one-token prompts padded to `width`, every row dropped."""
        request = Request((0,), 1, temperature=0.0 if greedy else 1.0)
        where = np.full((rows,), self.slots, np.int32)
        self._run_insert(np.zeros((rows, width), np.int32), np.ones((rows,), np.int32), [request] * rows, where, part)

    def _insert_rows(self, joining: int) -> int:
        """Rows of an insert of `joining` requests: the next power of two, a multiple of the insert unit (the
        mesh's data shards; two under batch-invariant decoding), at most the slots (rounded likewise)."""
        rows = 1 << (joining - 1).bit_length()
        unit = self._insert_unit
        return min(-(-rows // unit) * unit, -(-self.slots // unit) * unit)

    # ---- what it did ----

    @property
    def state(self):
        """The slots' loop state (LoopState, on device): for inspection, e.g. where its arrays lie on a mesh."""
        return self._state

    def stats(self) -> dict:
        """The loop's counters over every round so far (DecodeStats' fields, summed over rows), as host numbers."""
        counters = jax.tree.map(to_host, self._state.stats)
        return {name: np.asarray(value).tolist() for name, value in vars(counters).items()}

    def summary(self, generated_tokens: int, wall: float, compile_seconds: float = 0.0) -> dict:
        """decode's statistics summary of everything this engine ran."""
        return decode_stats.summarize(self.stats(), num_draft=self.cfg.num_draft,
                                      tree=self.cfg.tree, generated_tokens=generated_tokens, wall=wall,
                                      compile_seconds=compile_seconds)  # fmt: skip


def _bucket_edges(longest: int) -> list[int]:
    """Prompt lengths up to `longest` that reach every width `bucket` gives them: the widths below it, and it."""
    lengths, width = [], bucket(1)
    while width < longest:
        lengths.append(width)
        width = bucket(width + 1)
    return [*lengths, longest]
