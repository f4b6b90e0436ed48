"""`mtp_jax.stream_text`: pieces that add up to `generate_text`'s answer, a split character held back, bad input
refused in one line."""

from __future__ import annotations

import itertools

import pytest

import mtp_jax
from mtp_jax.runtime.errors import UserError
from tests.support.tiny_models import predictable_model, tiny_config

VOCAB = 24
PROMPT = [5, 6, 7, 8, 9]


class ByteTokenizer:
    """Token i is one byte: even ids the lead byte of "é" (0xC3), odd ids its continuation byte (0xA9); decoded as
    UTF-8 with U+FFFD for what does not form a character."""

    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(b"\xa9" if i % 2 else b"\xc3" for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def model():
    return predictable_model(cfg=tiny_config(vocab=VOCAB, eos=(VOCAB - 1,)))


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_pieces_add_up_to_the_answer_and_hold_back_split_characters(model, k):
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=30, stop_on_eos=False)
    tokenizer = ByteTokenizer()
    whole = mtp_jax.generate_text(model, [PROMPT], cfg, tokenizer=tokenizer).results[0]
    ids = whole.token_ids
    assert any(a % 2 == 0 and b % 2 == 1 for a, b in itertools.pairwise(ids)), ids  # an "é" split across two tokens
    pieces = list(mtp_jax.stream_text(model, PROMPT, cfg, tokenizer=tokenizer, chunk_tokens=1))
    assert "".join(pieces) == whole.text
    assert len(pieces) > 1 and all(pieces)
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1]), pieces


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tokenizer=None), "needs the model's tokenizer"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(cfg="greedy"), "cfg must be a DecodeConfig"),
    ],
)
def test_bad_arguments_are_one_line(model, kwargs, message):
    kwargs = {"tokenizer": ByteTokenizer(), **kwargs}
    with pytest.raises(UserError, match=message):
        next(mtp_jax.stream_text(model, PROMPT, **kwargs))
