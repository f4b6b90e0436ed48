"""One request's answer as text while its tokens come: `AnswerText.add` decodes the tokens so far (special tokens
skipped, as `generate_text` decodes them) and hands out the text past what it gave before.

Held back until more tokens come: a trailing incomplete character (a multi-byte character split across tokens
decodes as U+FFFD), and a tail that may be the start of a stop string. When a stop string appears the answer ends
before it.
"""

from __future__ import annotations

INCOMPLETE = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to


class AnswerText:
    """The text of one request's generated tokens, handed out piece by piece."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # the answer so far (cut before a stop string once one appeared)
        self.sent = ""  # what `add` handed out
        self.stopped = False  # a stop string ended the answer

    def add(self, tokens: list[int], finished: bool = False) -> str:
        """Take the request's next tokens (`finished`: its last ones); the new text to hand out ("" while none is
        ready). After a stop string, the answer is finished: `stopped` says so."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        text = self._tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = first_stop(text, self.stop)
        if cut is not None:
            text, finished, self.stopped = text[:cut], True, True
        self.text = text
        ready = text if finished else held_back(text.rstrip(INCOMPLETE), self.stop)
        piece = ready[len(self.sent) :] if ready.startswith(self.sent) else ""
        self.sent += piece
        return piece


def first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop string in `text` begins (None: none there)."""
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    return min(found) if found else None


def held_back(text: str, stop: tuple[str, ...]) -> str:
    """`text` without its longest tail that begins a stop string (which the next tokens may complete)."""
    longest = 0
    for s in stop:
        for size in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:size]):
                longest = size
                break
    return text[: len(text) - longest]
