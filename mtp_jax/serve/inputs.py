"""A request's prompt as token ids, as `generate_text` makes them (`decode.prompts.encode_prompts`): a completion's
text through the tokenizer alone (its token ids used exactly as given), a chat's messages through the chat template
with the generation prompt; and its budget checked against a slot's positions."""

from __future__ import annotations

import dataclasses

import jinja2

from mtp_jax.decode.prompts import encode_prompts
from mtp_jax.runtime.errors import UserError
from mtp_jax.serve.protocol import ApiError


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request must fit: a slot's positions (prompt and answer), the vocabulary, the model's context."""

    max_len: int
    vocab_size: int
    context: int


def completion_ids(tokenizer, prompt: str | list[int], limits: Limits) -> tuple[int, ...]:
    """A completion's prompt: text tokenized without a template, or token ids as given."""
    return encoded(prompt, tokenizer, chat=False, limits=limits)


def chat_ids(tokenizer, messages: list[dict], limits: Limits) -> tuple[int, ...]:
    """A chat's messages through the tokenizer's chat template, with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
    if not messages:
        raise ApiError(400, "messages: at least one message is needed", param="messages")
    if len(messages) == 1 and messages[0]["role"] == "user":  # exactly as encode_prompts makes it
        return encoded(messages[0]["content"], tokenizer, chat=True, limits=limits)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except jinja2.TemplateError as e:
        raise ApiError(400, f"messages: the chat template refused them ({e})", param="messages") from None
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return checked(ids, limits)


def encoded(item: str | list[int], tokenizer, *, chat: bool, limits: Limits) -> tuple[int, ...]:
    try:
        prompt = encode_prompts([item], tokenizer, chat=chat, vocab_size=limits.vocab_size, context=limits.context)[0]
    except UserError as e:
        raise ApiError(400, str(e).replace("prompt 0", "the prompt"), param="prompt") from None
    except jinja2.TemplateError as e:
        raise ApiError(400, f"the chat template refused the prompt ({e})", param="messages") from None
    return prompt.token_ids


def checked(ids: list[int], limits: Limits) -> tuple[int, ...]:
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        raise ApiError(400, f"the prompt has token ids outside the vocabulary [0, {limits.vocab_size})")
    return tuple(int(t) for t in ids)


def budget(prompt_ids: tuple[int, ...], max_tokens: int | None, limits: Limits) -> int:
    """Tokens the request may generate: `max_tokens`, or the rest of a slot when None; refused when the prompt and
    the budget do not fit in a slot."""
    room = limits.max_len - len(prompt_ids)
    if max_tokens is None:
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; a slot holds {limits.max_len} positions, "
                           "prompt and answer", param="messages")  # fmt: skip
        return room
    if max_tokens > room:
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({max_tokens}) take "
                       f"{len(prompt_ids) + max_tokens} positions; a slot holds {limits.max_len}",
                       param="max_tokens")  # fmt: skip
    return max_tokens
