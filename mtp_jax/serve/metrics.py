"""`GET /metrics`: Prometheus' text exposition format (version 0.0.4), written here. vLLM's metric names with an
`mtp_jax:` prefix, each labelled with the served model's name:

- gauges `num_requests_running` (requests in the engine's slots), `num_requests_waiting` (queued for a slot);
- counters `request_success_total` by `finished_reason` ("stop", "length", or "abort": cancelled, e.g. a client
  gone), `prompt_tokens_total`, `generation_tokens_total`;
- histograms `time_to_first_token_seconds` (submission to the first token handed out), `inter_token_latency_seconds`
  (tokens come in pieces of several rounds: each token of a piece counts as the piece's interval over its tokens),
  `e2e_request_latency_seconds`;
- the speculative counters of the engine's rounds (`Engine.stats()`, from the server's start on):
  `spec_decode_num_drafts_total` (row-rounds that drafted), `spec_decode_num_draft_tokens_total` (drafted),
  `spec_decode_num_accepted_tokens_total` (accepted), `spec_decode_num_accepted_tokens_per_pos_total{position}`.

`Metrics` is written by the worker thread and read by the server's: a lock guards it.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading

PREFIX = "mtp_jax:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's queue and its speculative counters at one moment (the worker takes it between steps)."""

    running: int = 0
    waiting: int = 0
    stats: dict = dataclasses.field(default_factory=dict)  # Engine.stats() since the server's start


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def generated(self, tokens: int, *, first_token_seconds: float | None, interval: float | None) -> None:
        """`tokens` new tokens of a request: `first_token_seconds` when they are its first, else the `interval`
        since its previous ones."""
        with self._lock:
            self.generation_tokens += tokens
            if first_token_seconds is not None:
                self.ttft.observe(first_token_seconds)
                tokens -= 1
            if interval is not None and tokens > 0:
                self.itl.observe(interval / tokens, tokens)

    def ended(self, reason: str, seconds: float) -> None:
        with self._lock:
            self.finished[reason] += 1
            self.e2e.observe(seconds)

    def render(self, engine: EngineSnapshot) -> str:
        """The exposition text."""
        label = f'model_name="{escape(self.model_name)}"'
        with self._lock:
            lines = gauge("num_requests_running", "Requests in the engine's slots.", label, engine.running)
            lines += gauge("num_requests_waiting", "Requests waiting for a slot.", label, engine.waiting)
            lines += family("request_success_total", "counter", "Finished requests by finished_reason.",
                            [(f'{label},finished_reason="{r}"', n) for r, n in self.finished.items()])  # fmt: skip
            lines += counter("prompt_tokens_total", "Prompt tokens admitted.", label, self.prompt_tokens)
            lines += counter("generation_tokens_total", "Tokens generated.", label, self.generation_tokens)
            lines += histogram("time_to_first_token_seconds", "Time to the first token.", label, self.ttft)
            lines += histogram("inter_token_latency_seconds", "Time between tokens.", label, self.itl)
            lines += histogram("e2e_request_latency_seconds", "Time from submission to the end.", label, self.e2e)
        lines += speculative(engine.stats, label)
        return "\n".join(lines) + "\n"


def speculative(stats: dict, label: str) -> list[str]:
    """The spec_decode counters from `Engine.stats()`: a row-round drafted when its first draft was judged."""
    reached, accepted_at = list(stats.get("reached", [])), list(stats.get("accepted_at", []))
    lines = counter("spec_decode_num_drafts_total", "Row-rounds that drafted.", label, reached[0] if reached else 0)
    lines += counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed.", label, stats.get("drafted", 0))
    lines += counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", label,
                     stats.get("accepted", 0))  # fmt: skip
    lines += family("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Draft tokens accepted by position.",
                    [(f'{label},position="{i}"', n) for i, n in enumerate(accepted_at)])  # fmt: skip
    return lines


def gauge(name: str, text: str, label: str, value) -> list[str]:
    return family(name, "gauge", text, [(label, value)])


def counter(name: str, text: str, label: str, value) -> list[str]:
    return family(name, "counter", text, [(label, value)])


def family(name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> list[str]:
    name = PREFIX + name
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *(f"{name}{{{lab}}} {number(v)}" for lab, v in samples)]


def histogram(name: str, text: str, label: str, h: Histogram) -> list[str]:
    full = PREFIX + name
    lines = [f"# HELP {full} {text}", f"# TYPE {full} histogram"]
    total = 0
    for bound, n in zip((*(repr(float(b)) for b in h.buckets), "+Inf"), h.counts, strict=True):
        total += n
        lines.append(f'{full}_bucket{{{label},le="{bound}"}} {total}')
    return [*lines, f"{full}_sum{{{label}}} {number(h.sum)}", f"{full}_count{{{label}}} {total}"]


def number(value) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
