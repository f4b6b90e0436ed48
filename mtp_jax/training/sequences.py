"""The data a head trains on: token sequences (prompt + response) read and checked, padded, and the frozen trunk's
hiddens over them computed once (with the outputs of the trunk layers a head with fused features reads)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.runtime.errors import UserError
from mtp_jax.training.head_training import Batch


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"))
def _trunk_hidden(graphdef, params, tokens, taps: tuple[int, ...]):
    """(final-normed hidden [B, T, D], the outputs of trunk layers `taps` [B, T, N, D] or None)."""
    model: CausalLM = nnx.merge(graphdef, params)
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    cache = model.new_cache(batch, 1)
    return model.trunk_taps(tokens, positions, cache, taps)


class SequenceData:
    """Token sequences (prompt + response), padded to `width`, with the frozen trunk's hiddens computed once (and
    the outputs of the layers a head with fused features reads)."""

    def __init__(self, model: CausalLM, records: list[dict], width: int, chunk: int = 8, progress=None):
        count = len(records)
        self.tokens = np.zeros((count, width), np.int32)
        self.lengths = np.zeros((count,), np.int32)
        self.loss_start = np.zeros((count,), np.int32)
        for i, record in enumerate(records):
            ids = record["token_ids"][:width]
            self.tokens[i, : len(ids)] = ids
            self.lengths[i] = len(ids)
            self.loss_start[i] = min(record.get("prompt_len", 0), len(ids))
        graphdef, params = nnx.split(model)
        d, taps = model.config.hidden_size, model.config.mtp.fused_layers if model.config.has_mtp else ()
        self.hidden = np.zeros((count, width, d), np.dtype(model.dtype))
        self.taps = np.zeros((count, width, len(taps), d), np.dtype(model.dtype)) if taps else None
        for start in range(0, count, chunk):
            rows = self.tokens[start : start + chunk]
            padded = np.zeros((chunk, width), np.int32)
            padded[: len(rows)] = rows  # fixed shape: one compile
            hidden, tapped = _trunk_hidden(graphdef, params, padded, taps)
            self.hidden[start : start + len(rows)] = np.asarray(hidden)[: len(rows)]
            if taps:
                self.taps[start : start + len(rows)] = np.asarray(tapped)[: len(rows)]
            if progress is not None:
                progress(len(rows))

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The batch of training step `step`: a seeded permutation per epoch, so a resumed run sees the same data."""
        per_epoch = max(len(self) // batch_size, 1)
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(len(self))
        rows = order[index * batch_size : (index + 1) * batch_size]
        if len(rows) < batch_size:
            rows = np.resize(order, batch_size)
        return Batch(
            tokens=jnp.asarray(self.tokens[rows]),
            hidden=jnp.asarray(self.hidden[rows]),
            lengths=jnp.asarray(self.lengths[rows]),
            loss_start=jnp.asarray(self.loss_start[rows]),
            taps=None if self.taps is None else jnp.asarray(self.taps[rows]),
        )


def read_records(path: str) -> list:
    """The JSON values of a JSONL file's non-blank lines; a line that is not UTF-8 JSON is refused by number."""
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if line.strip():
                    records.append(json.loads(line))
            except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
                raise UserError(f"{path}:{number}: not a line of UTF-8 JSON ({e})") from None
    return records


def check_sequences(records: list, vocab_size: int, path: str) -> None:
    """Refuse, by line, a record that is not {"token_ids": [ids in the vocabulary], "prompt_len": n >= 0}: an id
    outside [0, vocab_size) would index past the embedding and train the head to NaN."""
    integer = lambda v: isinstance(v, int) and not isinstance(v, bool)
    for number, record in enumerate(records, 1):
        ids = record.get("token_ids") if isinstance(record, dict) else None
        if not isinstance(ids, list) or not ids or not all(integer(t) for t in ids):
            raise UserError(f"{path}: record {number}: token_ids must be a non-empty list of integers")
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise UserError(f"{path}: record {number}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        prompt_len = record.get("prompt_len", 0)
        if not integer(prompt_len) or prompt_len < 0:
            raise UserError(f"{path}: record {number}: prompt_len must be an integer >= 0, got {prompt_len!r}")
