"""The response objects of both endpoints, whole (`stream: false`) and as server-sent events (`stream: true`:
`data: {chunk}` lines, then `data: [DONE]`): `text_completion` objects for `/v1/completions`, `chat.completion`
and `chat.completion.chunk` objects for `/v1/chat/completions`."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


@dataclasses.dataclass
class Shape:
    """One response's objects: its id, creation time and model name shared by every chunk. `chat`: chat
    completion objects, else text completions. `include_usage`: chunks carry `"usage": null`, and a last chunk
    (no choices) the usage."""

    model: str
    chat: bool
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        """The response of a request that did not stream."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            kind = "text_completion"
        return {**self.head(kind), "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None) -> dict:
        """A streamed chunk: new text (chat: None opens the assistant's message), or the finish reason."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            data = {**self.head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            data = {**self.head("text_completion"), "choices": [choice]}
        return {**data, "usage": None} if self.include_usage else data

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head(kind), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
