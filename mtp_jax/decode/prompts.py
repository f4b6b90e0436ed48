"""Prompts from the command line or a file, tokenized (chat template when the tokenizer has one), batched."""

from __future__ import annotations

import dataclasses
import io
import json
import os

import numpy as np

from mtp_jax.runtime.errors import UserError


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int
    text: str | None  # None for raw token ids
    token_ids: tuple[int, ...]


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


def read_prompt_file(path: str) -> list[str | list[int]]:
    """A .txt file (one prompt a line) or .jsonl ({"prompt": ...} or {"token_ids": [...]} a line)."""
    return [item for item, _ in read_prompt_records(path)]


def read_prompt_records(path: str) -> list[tuple[str | list[int], dict]]:
    """(prompt, per-row sampling overrides) for each prompt of a .txt or .jsonl file.

    A .jsonl line may carry any of "temperature", "top_k", "top_p", "seed" next to its prompt; they override the
    command line's values for that row only.
    """
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such prompts file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})") from None
    lines = [line.rstrip("\n") for line in io.StringIO(text, newline=None)]  # universal newlines, as open() reads
    records: list[tuple[str | list[int], dict]] = []
    if path.endswith(".jsonl"):
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{number}: invalid JSON ({e.msg})") from None
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                item = record["prompt"]
            elif isinstance(record, dict) and isinstance(record.get("token_ids"), list):
                item = record["token_ids"]
                if not item or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                    raise UserError(f"{path}:{number}: token_ids must be a non-empty list of integers")
            else:
                raise UserError(f'{path}:{number}: expected {{"prompt": "..."}} or {{"token_ids": [...]}}')
            records.append((item, _sampling_overrides(record, f"{path}:{number}")))
    else:
        records = [(line, {}) for line in lines if line.strip()]
    if not records:
        raise UserError(f"{path}: no prompts in file")
    return records


def _sampling_overrides(record: dict, where: str) -> dict:
    overrides = {name: record[name] for name in SAMPLING_FIELDS if name in record}
    for name, value in overrides.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        integer = number and isinstance(value, int)
        valid = {
            "temperature": number and value >= 0,
            "top_k": integer and value >= 0,
            "top_p": number and 0 < value <= 1,
            "seed": integer,
        }[name]
        if not valid:
            wanted = {"temperature": ">= 0", "top_k": "an integer >= 0", "top_p": "in (0, 1]", "seed": "an integer"}
            raise UserError(f"{where}: {name} must be {wanted[name]}, got {value!r}")
    return overrides


def encode_prompts(items, tokenizer, *, chat: bool, vocab_size: int, context: int) -> list[Prompt]:
    """Token ids for each prompt; raw token ids are used exactly as given."""
    prompts = []
    for index, item in enumerate(items):
        if isinstance(item, list):
            ids = [int(t) for t in item]
            text = None
        else:
            if tokenizer is None:
                raise UserError("this model has no tokenizer: give prompts as token_ids in a .jsonl file")
            text = item
            if chat and getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": item}], add_generation_prompt=True, tokenize=True
                )
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            else:
                ids = tokenizer(item)["input_ids"]
        if not ids:
            raise UserError(f"prompt {index} is empty")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise UserError(f"prompt {index} has token ids outside the vocabulary [0, {vocab_size})")
        if len(ids) >= context:
            raise UserError(f"prompt {index} has {len(ids)} tokens; the model's context is {context}")
        prompts.append(Prompt(index, text, tuple(ids)))
    return prompts


def bucket(length: int, minimum: int = 16) -> int:
    """Padded width for a prompt length: `minimum` times a power of two or 1.5 times one (16, 24, 32, 48, 64, 96,
    ...), so few shapes get compiled while the prefill and every step's attention pay for at most a third of
    padding (powers of two alone: up to half)."""
    width = minimum
    while width < length:
        if width % 2 == 0 and width * 3 // 2 >= length:
            return width * 3 // 2
        width *= 2
    return width


def pad_batch(prompts: list[Prompt], batch_size: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids [batch_size, width] and lengths [batch_size]; missing rows repeat the first prompt."""
    rows = list(prompts) + [prompts[0]] * (batch_size - len(prompts))
    ids = np.zeros((batch_size, width), np.int32)
    lens = np.zeros((batch_size,), np.int32)
    for row, prompt in enumerate(rows):
        ids[row, : len(prompt.token_ids)] = prompt.token_ids
        lens[row] = len(prompt.token_ids)
    return ids, lens
