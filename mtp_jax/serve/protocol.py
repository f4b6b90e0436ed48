"""What the server takes and how it refuses: the OpenAI request bodies of `/v1/completions` and
`/v1/chat/completions` as pydantic models (an unknown field or a wrong type is refused), their values checked into
`Settings`, and OpenAI-style errors (`{"error": {"message", "type", "param", "code"}}`) as `ApiError`.

Fields: `model, prompt | messages, max_tokens (max_completion_tokens for chat), temperature (default 1.0, OpenAI's;
0 is greedy), top_p, top_k (vLLM's extension; 0 or -1: off), seed (none: a random one), stop (a string or up to 4,
each of at most 500 characters), stream, stream_options.include_usage, n (1 only), user (ignored)`;
`presence_penalty` and `frequency_penalty` are taken at 0 only, as many clients send them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 500  # each stop string's (the engine's thread looks for them after every piece of every request)
SEED_LIMIT = 2**63  # seeds are 64-bit signed integers
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest of the slot)
ERROR_TYPES = {401: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request refused: its HTTP status and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Sampling(Strict):
    """The fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")


class CompletionRequest(Sampling):
    prompt: Any

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value):
        """A string or a list of token ids, or a list of one of either (one prompt a request)."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        raise ValueError("must be a string or a list of token ids (one prompt a request)")


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value):
        """A string, or text parts (joined)."""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            try:
                return "".join(TextPart.model_validate(part).text for part in value)
            except ValidationError:
                pass
        raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')


class ChatRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """A request's decoding settings, checked. `max_tokens` None: as much as the slot holds."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse(model: type[Strict], raw: bytes) -> Strict:
    """The request body as `model`, or an ApiError (400) naming the first thing wrong."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deep") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param) from None


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a ValidationError's first problem: `param` the field's dotted path."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return f"unknown field: {param}", param
    if first["type"] == "missing":
        return f"missing field: {param}", param
    message = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
    return f"{param}: {message}", param


def settings(request: Sampling) -> Settings:
    """`request`'s settings, each value checked (an ApiError 400 naming it otherwise)."""
    max_tokens = request.max_tokens
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    check(max_tokens is None or max_tokens >= 1, "max_tokens", "must be >= 1")
    temperature = 1.0 if request.temperature is None else request.temperature
    check(0 <= temperature <= 2, "temperature", "must be in [0, 2]")
    top_p = 1.0 if request.top_p is None else request.top_p
    check(0 < top_p <= 1, "top_p", "must be in (0, 1]")
    top_k = 0 if request.top_k is None else request.top_k
    check(top_k >= -1, "top_k", "must be >= 1, or 0 or -1 (off)")
    check(request.seed is None or -SEED_LIMIT <= request.seed < SEED_LIMIT, "seed", "must be a 64-bit integer")
    check(request.n in (None, 1), "n", "only 1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        check(getattr(request, name) in (None, 0), name, "only 0 is supported")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    check(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
    check(all(0 < len(s) <= MAX_STOP_CHARS for s in stop), "stop", f"each of 1 to {MAX_STOP_CHARS} characters")
    stream = bool(request.stream)
    check(request.stream_options is None or stream, "stream_options", "only with stream: true")
    include_usage = bool(stream and request.stream_options and request.stream_options.include_usage)
    return Settings(max_tokens, float(temperature), float(top_p), max(top_k, 0), request.seed, stop, stream,
                    include_usage)  # fmt: skip


def check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, f"{param}: {message}", param=param)
