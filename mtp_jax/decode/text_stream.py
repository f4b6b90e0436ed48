"""`stream_text`: one prompt's answer as it is generated, for a chat window or a terminal.

The decode loop runs in pieces (`speculative.generate_chunks`: one jitted call per `chunk_tokens` tokens, its state
kept on device between calls), the same rounds `generate_text` runs, so the pieces of text add up to
`generate_text`'s answer (with a tokenizer that decodes a prefix of the tokens to a prefix of the text, as
byte-level BPE tokenizers do). After each piece the tokens so far are decoded and the new text is yielded; a trailing
incomplete character (a multi-byte character split across tokens decodes as U+FFFD) waits for the next piece.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode import speculative, stats
from mtp_jax.decode.prompts import Prompt, bucket, encode_prompts, pad_batch
from mtp_jax.decode.text import (
    TextResult,
    batch_results,
    batch_rows,
    check_budget,
    checked_config,
    checked_prompts,
    row_sampling,
)
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.parallel.sharding import to_host
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.errors import UserError

INCOMPLETE = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to


def stream_text(
    model: CausalLM,
    prompt: str | Sequence[int],
    cfg: DecodeConfig | None = None,
    *,
    tokenizer=None,
    chat: bool = True,
    seed: int = 0,
    chunk_tokens: int = 16,
) -> Iterator[str]:
    """Pieces of the answer to `prompt` (a string, or token ids used exactly as given) as they are generated;
    joined, they are `generate_text(model, [prompt], cfg, tokenizer=..., chat=..., seed=...)`'s text. Arguments
    as `generate_text` takes them; `chunk_tokens`: tokens per piece (at least; a round may add up to k + 1)."""
    if tokenizer is None:
        raise UserError("stream_text needs the model's tokenizer (mtp_jax.load returns it beside the model)")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise UserError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    cfg = checked_config(model, cfg)
    encoded = encode_prompts(checked_prompts([prompt]), tokenizer, chat=chat, vocab_size=model.config.vocab_size,
                             context=model.config.max_position_embeddings)  # fmt: skip
    rows = batch_rows(model, 1, 1)  # 1, or the mesh's data shards (the prompt repeated)
    check_budget(model, encoded, cfg, rows)
    ids, lens = pad_batch(encoded, rows, bucket(len(encoded[0].token_ids)))  # [rows, width], [rows]
    keys, sampling = row_sampling(cfg, seed)(np.zeros(rows, np.int64))
    outputs = speculative.generate_chunks(model, ids, lens, keys, cfg, sampling, chunk_tokens)
    for piece, _ in text_pieces(outputs, tokenizer, cfg.max_new_tokens):
        if piece:
            yield piece


def stream_prompt(model: CausalLM, tokenizer, prompt: Prompt, cfg: DecodeConfig, sampling_for: Callable,
                  on_text: Callable[[str], None], chunk_tokens: int = 16) -> tuple[TextResult, dict]:  # fmt: skip
    """Decode one encoded prompt as `python -m mtp_jax.decode` does on a terminal, handing its text to `on_text`
    piece by piece: (its result, the statistics summary `text.decode_batches` gives). The programs are compiled
    ahead (`speculative.compile_chunks`), so the summary keeps the compile apart as decode_batches does."""
    rows = batch_rows(model, 1, 1)
    ids, lens = pad_batch([prompt], rows, bucket(len(prompt.token_ids)))  # [rows, width], [rows]
    keys, sampling = sampling_for(np.full(rows, prompt.index))
    start, (hits_before, misses_before) = time.perf_counter(), compile_cache.lookups()
    program = speculative.compile_chunks(model, ids, lens, keys, cfg, sampling)
    compile_seconds, (hits, misses) = time.perf_counter() - start, compile_cache.lookups()
    start = time.perf_counter()
    pieces = text_pieces(program(model, ids, lens, keys, cfg, sampling, chunk_tokens), tokenizer, cfg.max_new_tokens)
    for piece, out in pieces:
        last = out
        if piece:
            on_text(piece)
    wall = time.perf_counter() - start
    result = batch_results([prompt], last, tokenizer)[0]
    summary = stats.summarize(stats.add(None, last.stats), num_draft=cfg.num_draft, tree=cfg.tree,
                              generated_tokens=result.num_tokens, wall=wall, compile_seconds=compile_seconds,
                              compile_from_cache=hits > hits_before and misses == misses_before)  # fmt: skip
    return result, summary


def text_pieces(outputs: Iterator[speculative.GenerateOutput], tokenizer, max_new_tokens: int):
    """(new text, output) for each output of `generate_chunks` (row 0): the text of the tokens so far past what
    was given before, a trailing incomplete character held back until the row is done ("" while none is new)."""
    sent = ""
    for out in outputs:
        tokens, length = to_host(out.tokens)[0], int(to_host(out.lengths)[0])
        text = tokenizer.decode(tokens[:length].tolist(), skip_special_tokens=True)
        done = length >= max_new_tokens or bool(to_host(out.finished_by_eos)[0])
        ready = text if done else text.rstrip(INCOMPLETE)
        piece = ready[len(sent) :] if ready.startswith(sent) else ""
        sent += piece
        yield piece, out
