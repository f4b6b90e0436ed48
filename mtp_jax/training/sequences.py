"""The data a head trains on: token sequences (prompt + response) read and checked, padded, and the frozen trunk's
hiddens over them computed once (with the outputs of the trunk layers a head with fused features reads), and kept on
disk between runs where asked: computing them is most of a short stage's time on a CPU (the default model: about 1.7
sequences of 320 tokens a second on 2 cores), and held on disk they are memory-mapped rather than resident."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.kernels.cpu import cpu_rows
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


HEAD_PATHS = nnx.Any(nnx.PathContains("mtp"), nnx.PathContains("draft_vocab"), nnx.PathContains("draft_table"))
VALUES_SAMPLE = 4096  # values of each trunk array the cache key digests


def hiddens_key(model: CausalLM, tokens: np.ndarray, taps: tuple[int, ...]) -> str:
    """What the trunk's hiddens over `tokens` [N, T] depend on: the trunk's config and a sample of its weights' values
    (not the head's: a stage's head changes, its trunk does not), the tapped layers, the dtype, the backend and the
    CPU kernel's level (the numerics), and the tokens."""
    digest = hashlib.sha256()
    trunk_config = dataclasses.replace(model.config, mtp=None)
    digest.update(repr((trunk_config, taps, str(model.dtype), jax.default_backend(), cpu_rows.level())).encode())
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Not(HEAD_PATHS))):
        digest.update(np.asarray(jnp.ravel(leaf)[:VALUES_SAMPLE]).tobytes())
    digest.update(np.ascontiguousarray(tokens).tobytes())
    return digest.hexdigest()[:32]


class SequenceData:
    """Token sequences (prompt + response), padded to `width`, with the frozen trunk's hiddens computed once (and
    the outputs of the layers a head with fused features reads). `cache_dir`: keep them there (`hiddens_key` names a
    folder of .npy files, written whole before it is renamed into place) and read them back memory-mapped."""

    def __init__(self, model: CausalLM, records: list[dict], width: int, chunk: int = 8, progress=None,
                 cache_dir: str | None = None):  # fmt: skip
        count = len(records)
        self.tokens = np.zeros((count, width), np.int32)
        self.lengths = np.zeros((count,), np.int32)
        self.loss_start = np.zeros((count,), np.int32)
        for i, record in enumerate(records):
            ids = record["token_ids"][:width]
            self.tokens[i, : len(ids)] = ids
            self.lengths[i] = len(ids)
            self.loss_start[i] = min(record.get("prompt_len", 0), len(ids))
        taps = model.config.mtp.fused_layers if model.config.has_mtp else ()
        if not cache_dir:
            self.hidden, self.taps = self._fill(model, taps, chunk, progress, None)
            return
        folder = os.path.join(cache_dir, hiddens_key(model, self.tokens, taps))
        if os.path.isdir(folder):
            if progress is not None:
                progress(count)
        else:
            partial = f"{folder}.partial-{os.getpid()}"
            self._fill(model, taps, chunk, progress, partial)
            if os.path.isdir(folder):  # another run kept the same hiddens meanwhile
                shutil.rmtree(partial)
            else:
                os.replace(partial, folder)
        self.hidden = np.load(os.path.join(folder, "hidden.npy"), mmap_mode="r")
        self.taps = np.load(os.path.join(folder, "taps.npy"), mmap_mode="r") if taps else None

    def _fill(self, model: CausalLM, taps: tuple[int, ...], chunk: int, progress, folder: str | None):
        """The trunk's hiddens [N, T, D] and taps [N, T, len(taps), D] (or None), in memory, or in .npy files in
        `folder`."""
        count, width = self.tokens.shape
        shapes = {"hidden": (count, width, model.config.hidden_size)}
        if taps:
            shapes["taps"] = (count, width, len(taps), model.config.hidden_size)
        dtype = np.dtype(model.dtype)
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
            file = lambda name: os.path.join(folder, f"{name}.npy")
            arrays = {name: np.lib.format.open_memmap(file(name), "w+", dtype, shape) for name, shape in shapes.items()}
        else:
            arrays = {name: np.zeros(shape, dtype) for name, shape in shapes.items()}
        graphdef, params = nnx.split(model)
        for start in range(0, count, chunk):
            rows = self.tokens[start : start + chunk]
            padded = np.zeros((chunk, width), np.int32)
            padded[: len(rows)] = rows  # fixed shape: one compile
            hidden, tapped = _trunk_hidden(graphdef, params, padded, taps)
            arrays["hidden"][start : start + len(rows)] = np.asarray(hidden)[: len(rows)]
            if taps:
                arrays["taps"][start : start + len(rows)] = np.asarray(tapped)[: len(rows)]
            if progress is not None:
                progress(len(rows))
        for array in arrays.values():
            if isinstance(array, np.memmap):
                array.flush()
        return arrays["hidden"], arrays.get("taps")

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
