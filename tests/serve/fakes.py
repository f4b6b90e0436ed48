"""Stand-ins for the HTTP layer's tests: a byte tokenizer, and an engine with the `Engine`'s queue, cancel and update
semantics whose answer to a prompt is the prompt's own tokens (an echo), then EOS."""

from __future__ import annotations

import dataclasses
import threading

from mtp_jax.decode.engine import Request, Update

EOS = 256  # the byte tokenizer's one special token
VOCAB = 257


class ByteTokenizer:
    """Token i < 256 is the byte i; decoded as UTF-8 (U+FFFD for what does not form a character). Its chat template
    writes each message as "<role>content" and opens "<assistant>"."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(text.encode())}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return list(text.encode()) if tokenize else text

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclasses.dataclass
class Row:
    request_id: int
    request: Request
    answer: list[int]
    sent: int = 0


class EchoEngine:
    """`slots` rows; each step hands every running request its next `per_step` tokens of the echo. `gate`: when set,
    a step waits for it (a test holds requests running); `fail`: the next step raises."""

    def __init__(self, slots: int = 2, max_len: int = 256, per_step: int = 3, echo_of=None):
        self.slots, self.max_len, self.per_step = slots, max_len, per_step
        self.echo_of = echo_of or (lambda ids: list(ids))
        self.rows: list[Row | None] = [None] * slots
        self.queue: list[tuple[int, Request]] = []
        self.released: set[int] = set()
        self.cancelled: list[int] = []
        self.submitted: list[Request] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.next_id = 0

    def submit(self, request: Request) -> int:
        if len(request.prompt_ids) + request.max_tokens > self.max_len:
            raise ValueError("too long for a slot")
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.queue.append((request_id, request))
        self.submitted.append(request)
        return request_id

    def cancel(self, request_id: int) -> bool:
        self.cancelled.append(request_id)
        for i, (waiting_id, _) in enumerate(self.queue):
            if waiting_id == request_id:
                del self.queue[i]
                return True
        if any(row is not None and row.request_id == request_id for row in self.rows):
            self.released.add(request_id)
            return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.running > 0

    @property
    def running(self) -> int:
        return sum(row is not None for row in self.rows)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def step(self) -> list[Update]:
        self.gate.wait(30)
        if self.fail:
            raise RuntimeError("the device fell over")
        updates = []
        for slot, row in enumerate(self.rows):
            if row is not None and row.request_id in self.released:
                updates.append(Update(row.request_id, [], True, "cancelled"))
                self.rows[slot] = None
        self.released.clear()
        for slot in range(self.slots):
            if self.rows[slot] is None and self.queue:
                request_id, request = self.queue.pop(0)
                answer = [*self.echo_of(request.prompt_ids), EOS][: request.max_tokens]
                self.rows[slot] = Row(request_id, request, answer)
        for slot, row in enumerate(self.rows):
            if row is None:
                continue
            new = row.answer[row.sent : row.sent + self.per_step]
            row.sent += len(new)
            done = row.sent == len(row.answer)
            reason = ("eos" if row.answer[-1] == EOS else "length") if done else None
            updates.append(Update(row.request_id, new, done, reason))
            if done:
                self.rows[slot] = None
        return updates

    def stats(self) -> dict:
        return {"rounds": 10, "row_rounds": 12, "emitted": 20, "drafted": 24, "accepted": 9, "reached": [12, 6],
                "accepted_at": [6, 3], "rounds_with": [0, 0, 10], "rests": 0}  # fmt: skip
