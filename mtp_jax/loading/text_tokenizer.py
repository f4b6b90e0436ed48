"""A tokenizer folder's `tokenizer.json` and chat template on the `tokenizers` package and jinja2 alone: the part of
transformers' tokenizer that decoding uses (encode, chat template, decode), loaded without importing transformers,
which takes seconds (measured: docs/benchmarks.md#warm-start). The warm-start cache of the default model loads its
tokenizer so.

It renders the chat template as transformers does (sandboxed jinja2, trim_blocks and lstrip_blocks, the same
`raise_exception`, `tojson` and `strftime_now`, the special tokens as variables) and encodes the rendered text
without adding special tokens; tests/loading/test_warm_start.py checks it against transformers' tokenizer.
"""

from __future__ import annotations

import datetime
import functools
import json
import os

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mtp_jax.runtime.errors import ConversionError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TextTokenizer:
    """Encode text (optionally through the chat template) to token ids and decode ids to text."""

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None, special_tokens: dict[str, str]):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # {"eos_token": "<|im_end|>", ...}: variables of the template

    @classmethod
    def from_folder(cls, folder: str) -> TextTokenizer:
        """The tokenizer a `save_pretrained` wrote into `folder` (tokenizer.json, tokenizer_config.json and, where
        transformers puts it there, chat_template.jinja)."""
        try:
            backend = tokenizers.Tokenizer.from_file(os.path.join(folder, TOKENIZER_JSON))
            with open(os.path.join(folder, TOKENIZER_CONFIG), encoding="utf-8") as f:
                config = json.load(f)
            template = config.get("chat_template")
            template_file = os.path.join(folder, CHAT_TEMPLATE_FILE)
            if os.path.isfile(template_file):
                with open(template_file, encoding="utf-8") as f:
                    template = f.read()
        except (OSError, ValueError, tokenizers.Exception) as e:
            raise ConversionError(f"{folder}: cannot read its tokenizer ({e})") from None
        special = {name: config[name] for name in SPECIAL_TOKENS if isinstance(config.get(name), str)}
        return cls(backend, template, special)

    def __call__(self, text: str) -> dict[str, list[int]]:
        """{"input_ids": ids of `text`, with the special tokens the tokenizer adds}."""
        return {"input_ids": self.backend.encode(text).ids}

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True, return_dict: bool = False
    ):
        """The conversation through the chat template: the text, or (`tokenize`) its token ids, as a list or
        (`return_dict`, as transformers' tokenizers return by default since 5.0) as {"input_ids": ids}."""
        text = compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )
        if not tokenize:
            return text
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return {"input_ids": ids} if return_dict else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=8)
def compiled_template(template: str) -> jinja2.Template:
    """`template` compiled in an environment like the one transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)
