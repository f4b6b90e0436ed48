"""`Worker`: the one thread that owns the `Engine` (which is not thread-safe). The server's thread hands it jobs and
cancellations through a queue; it steps the engine while a request waits or runs and sleeps on the queue when none
does. Each job's new text goes to the job's asyncio queue on the server's event loop (`call_soon_threadsafe`), as
`Event`s: pieces of text, then one with the finish reason ("stop": EOS or a stop string, "length": max_tokens).

A stop string ends the answer before it and cancels the request in the engine, whose slot is then freed at the next
step; so does a cancelled job (a client gone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import sys
import threading
import time
import traceback

import jax

from mtp_jax.decode.engine import Engine, Request, Update
from mtp_jax.serve.detokenize import AnswerText
from mtp_jax.serve.metrics import EngineSnapshot, Metrics
from mtp_jax.serve.protocol import ApiError

FINISH_REASONS = {"eos": "stop", "length": "length", "cancelled": "abort"}  # the engine's -> OpenAI's


@dataclasses.dataclass(frozen=True)
class Event:
    """What a job got: new `text`; with the last event its `finish_reason`, its whole answer and token count; or an
    `error` (the job is then over)."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    answer: str = ""
    error: ApiError | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """One request: what to decode, and the event loop and queue its events go to."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    over: bool = False  # its last event is on its way (set on the worker's thread)

    def request(self) -> Request:
        """The engine's request. Its random stream is key(seed) for a 32-bit seed; a wider seed (which `key` would
        cut to its low 32 bits) folds its high bits into that key."""
        low, high = self.seed % 2**32, self.seed // 2**32
        key = None if high == 0 else jax.random.fold_in(jax.random.key(low), high % 2**32)
        return Request(self.prompt_ids, self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                       top_p=self.top_p, seed=low, key=key)  # fmt: skip

    def send(self, event: Event) -> None:
        """Hand `event` to the job's event loop (dropped when that loop is closed: the server is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass


@dataclasses.dataclass
class Running:
    job: Job
    answer: AnswerText
    last: float | None = None  # when its previous tokens came


class Worker:
    """The engine's thread (see the module's docstring). `baseline`: the engine's stats before serving (a warm-up's
    rounds), left out of the metrics."""

    def __init__(self, engine: Engine, tokenizer, metrics: Metrics, baseline: dict | None = None):
        self.engine, self.metrics = engine, metrics
        self._tokenizer = tokenizer
        self._baseline = baseline or {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._running: dict[int, Running] = {}  # engine request id -> its job
        self._ids: dict[Job, int] = {}
        self._thread = threading.Thread(target=self._run, name="mtp_jax.serve engine", daemon=True)
        self.failure: str | None = None  # why the engine stopped, when it failed

    # ---- the server's side (any thread) ----

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def submit(self, job: Job) -> None:
        self._put("submit", job)

    def cancel(self, job: Job) -> None:
        self._put("cancel", job)

    def snapshot(self) -> concurrent.futures.Future:
        """A future of the engine's `EngineSnapshot`, taken between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put("snapshot", future)
        return future

    def _put(self, kind: str, item) -> None:
        self._commands.put((kind, item))
        if not self._thread.is_alive():  # stopped (closed or failed): nobody else answers it
            self._drain_commands()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is left, stop the thread and wait for it (at most `timeout` seconds)."""
        self._commands.put(("close", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the engine's thread ----

    def _run(self) -> None:
        try:
            while self._handle(self._take()):
                if self.engine.busy:
                    self._step()
        except Exception as e:  # the engine failed: every request still there ends with the error
            self.failure = f"the engine failed: {type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            self._end_all(ApiError(500, self.failure))
        finally:
            self._drain_commands()

    def _take(self) -> list:
        """The commands queued: waits for one while the engine has nothing to do."""
        commands = [] if self.engine.busy else [self._commands.get()]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, commands: list) -> bool:
        """Run `commands`; False once told to close."""
        for kind, item in commands:
            if kind == "submit":
                self._submit(item)
            elif kind == "cancel":
                self._cancel(item)
            elif kind == "snapshot":
                resolve(item, self._snapshot())
            else:
                self._end_all(ApiError(503, "the server is shutting down"))
                return False
        return True

    def _submit(self, job: Job) -> None:
        try:
            request_id = self.engine.submit(job.request())
        except ValueError as e:
            job.over = True
            job.send(Event("", error=ApiError(400, str(e))))
            return
        self._ids[job] = request_id
        self._running[request_id] = Running(job, AnswerText(self._tokenizer, job.stop))
        self.metrics.admitted(len(job.prompt_ids))

    def _cancel(self, job: Job) -> None:
        request_id = self._ids.pop(job, None)
        if request_id is not None and self._running.pop(request_id, None) is not None:
            self.engine.cancel(request_id)
            job.over = True
            self.metrics.ended("abort", time.monotonic() - job.submitted)

    def _step(self) -> None:
        updates = self.engine.step()
        now = time.monotonic()
        for update in updates:
            if update.request_id in self._running:
                self._deliver(update, now)

    def _deliver(self, update: Update, now: float) -> None:
        running = self._running[update.request_id]
        job, answer = running.job, running.answer
        if update.tokens:
            first = now - job.submitted if running.last is None else None
            interval = None if running.last is None else now - running.last
            self.metrics.generated(len(update.tokens), first_token_seconds=first, interval=interval)
            running.last = now
        piece = answer.add(update.tokens, update.finished)
        reason = "stop" if answer.stopped else FINISH_REASONS.get(update.finish_reason) if update.finished else None
        if answer.stopped and not update.finished:
            self.engine.cancel(update.request_id)  # its slot is freed at the next step
        if reason is None:
            if piece:
                job.send(Event(piece))
            return
        del self._running[update.request_id]
        self._ids.pop(job, None)
        job.over = True
        self.metrics.ended(reason, now - job.submitted)
        job.send(Event(piece, reason, len(answer.ids), answer.text))

    def _snapshot(self) -> EngineSnapshot:
        stats = self.engine.stats()
        since = {name: minus(value, self._baseline.get(name)) for name, value in stats.items()}
        return EngineSnapshot(self.engine.running, self.engine.waiting, since)

    def _end_all(self, error: ApiError) -> None:
        """End every job still there with `error`, cancelled in the engine where it can still take a cancel."""
        for request_id, running in list(self._running.items()):
            if self.failure is None:
                self.engine.cancel(request_id)
            running.job.over = True
            running.job.send(Event("", error=error))
            self.metrics.ended("abort", time.monotonic() - running.job.submitted)
        self._running.clear()
        self._ids.clear()

    def _drain_commands(self) -> None:
        """After the loop: refuse what is still queued (jobs end with an error, snapshots get an empty one)."""
        error = ApiError(503, self.failure or "the server is shutting down")
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                item.over = True
                item.send(Event("", error=error))
            elif kind == "snapshot":
                resolve(item, EngineSnapshot())


def resolve(future: concurrent.futures.Future, value) -> None:
    """Give `future` its result, unless its asker gave up on it (cancelled it)."""
    try:
        future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def minus(value, base):
    """A counter (a number or a list of numbers) less its `base` value (None: nothing to take off)."""
    if base is None:
        return value
    if isinstance(value, list):
        return [v - b for v, b in zip(value, base, strict=True)]
    return value - base


def warm_up(engine: Engine, prompt_ids: tuple[int, ...], max_tokens: int = 2) -> dict:
    """Run one small greedy request through `engine` (its first insert and rounds compile here, not in a client's
    latency); the engine's stats after it."""
    engine.submit(Request(prompt_ids, max_tokens))
    while engine.busy:
        engine.step()
    return engine.stats()
