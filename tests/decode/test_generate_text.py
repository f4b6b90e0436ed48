"""`mtp_jax.generate_text`: the same tokens as `generate` on the batches it forms, text as the tokenizer decodes it,
finish reasons, and one clear line for bad input."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.runtime.errors import UserError
from tests.support.tiny_models import predictable_model, tiny_config

VOCAB = 24
PROMPTS = [[5, 6, 7, 8, 9], [11], [12, 13, 14], [20, 21, 22, 23, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [9]]
CFG = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=10)


class WordTokenizer:
    """Token i is the word "w<i>"; no chat template. What generate_text needs of a tokenizer, and no more."""

    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [int(word[1:]) for word in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i == 0))


def model_with_eos(eos: int):
    return predictable_model(cfg=tiny_config(vocab=VOCAB, eos=(eos,)))


def reference(model, prompts: list[list[int]], batch_size: int, cfg) -> list[tuple[list[int], bool]]:
    """(generated ids, ended by EOS) per prompt from `generate`, on the batches `generate_text` documents: input
    order, right-padded to the batch's bucketed width, missing rows filled with the batch's first prompt."""
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        rows = batch + [batch[0]] * (batch_size - len(batch))
        width = 16 if max(map(len, rows)) <= 16 else 24
        ids = np.zeros((batch_size, width), np.int32)
        for r, p in enumerate(rows):
            ids[r, : len(p)] = p
        lens = np.array([len(p) for p in rows], np.int32)
        res = mtp_jax.generate(model, ids, lens, jax.random.key(0), cfg)
        tokens, lengths, eos = np.asarray(res.tokens), np.asarray(res.lengths), np.asarray(res.finished_by_eos)
        out += [(tokens[r, : lengths[r]].tolist(), bool(eos[r])) for r in range(len(batch))]
    return out


@pytest.fixture(scope="module")
def eos_model():
    """A tiny model whose EOS is a token one prompt's answer reaches mid-way and another's never does."""
    plain_cfg = dataclasses.replace(CFG, num_draft=0)
    plain = reference(model_with_eos(VOCAB - 1), PROMPTS, len(PROMPTS), plain_cfg)  # one batch: one compile
    for token in range(1, VOCAB):
        ends = [token in ids[1:-1] for ids, _ in plain]  # reached after the first token, before the budget
        never = [token not in ids for ids, _ in plain]
        if any(ends) and any(never):
            return model_with_eos(token)
    pytest.fail("no token ends one row early and leaves another")


@pytest.mark.slow
def test_tokens_and_finish_reasons_equal_generate_on_the_same_batches(eos_model):
    out = mtp_jax.generate_text(eos_model, PROMPTS, CFG, batch_size=2)
    expected = reference(eos_model, PROMPTS, 2, CFG)
    assert [r.index for r in out.results] == list(range(len(PROMPTS)))
    assert [r.token_ids for r in out.results] == [ids for ids, _ in expected]
    assert [r.finish_reason for r in out.results] == ["eos" if e else "length" for _, e in expected]
    assert {"eos", "length"} <= {r.finish_reason for r in out.results}  # EOS in the middle of a batch
    assert all(r.prompt == p and r.text == "" for r, p in zip(out.results, PROMPTS, strict=True))
    assert out.stats["generated_tokens"] == sum(r.num_tokens for r in out.results)
    assert out.stats["num_draft"] == 2 and out.stats["compile_seconds"] > 0


@pytest.mark.slow
def test_text_prompts_are_tokenized_and_answers_decoded_by_the_tokenizer(eos_model):
    tokenizer = WordTokenizer()
    texts = [" ".join(f"w{i}" for i in p) for p in PROMPTS]
    out = mtp_jax.generate_text(eos_model, texts, CFG, tokenizer=tokenizer, batch_size=2)
    by_ids = mtp_jax.generate_text(eos_model, PROMPTS, CFG, batch_size=2)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in by_ids.results]
    assert out.texts == [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in out.results]
    assert out.results[0].prompt == texts[0]
    assert out.results[0].row() == {"index": 0, "prompt": texts[0], "text": out.texts[0],
                                    "token_ids": out.results[0].token_ids, "num_tokens": out.results[0].num_tokens,
                                    "finish_reason": out.results[0].finish_reason}  # fmt: skip


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([], {}, "prompts is empty"),
        ("w1 w2", {}, "put one prompt in a list"),
        (None, {}, "got NoneType"),
        ([[1, 2], 3], {}, "prompt 1 must be a string or a list of token ids"),
        ([[1, 2.5]], {}, "prompt 0 must be"),
        ([["w1"]], {}, "prompt 0 must be"),
        (["w1 w2"], {"tokenizer": None}, "this model has no tokenizer"),
        ([[1, 2]], {"cfg": {"num_draft": 2}}, "cfg must be a DecodeConfig"),
        ([[1, 2]], {"batch_size": 0}, "batch_size must be an integer >= 1"),
        ([[1, 99]], {}, "outside the vocabulary"),
        ([[]], {}, "prompt 0 is empty"),
    ],
)
def test_bad_input_is_one_clear_user_error(eos_model, prompts, kwargs, message):
    kwargs = {"cfg": CFG, **kwargs}
    with pytest.raises(UserError, match=message):
        mtp_jax.generate_text(eos_model, prompts, kwargs.pop("cfg"), **kwargs)


@pytest.mark.slow
def test_drafts_asked_of_a_model_without_a_head():
    model = mtp_jax.CausalLM(tiny_config(vocab=VOCAB).replace(mtp=None), rngs=nnx.Rngs(0))
    with pytest.raises(UserError, match="no MTP head"):
        mtp_jax.generate_text(model, [[1, 2]], CFG)
    out = mtp_jax.generate_text(model, [[1, 2]])  # the default config: no drafts for a model without a head
    assert out.stats["num_draft"] == 0 and 1 <= out.results[0].num_tokens <= 128
