"""Random token ids for tests: plain, and right-padded prompts of different lengths (no torch needed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def random_tokens(seed: int, shape: tuple[int, ...], vocab: int) -> np.ndarray:
    """Token ids uniform in [0, vocab), int32, of `shape` (e.g. [B, T]), from numpy's generator seeded `seed`."""
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def padded_prompts(seed: int, lens: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray:
    """ids [B, max(lens)] int32, B = len(lens): `random_tokens(seed, ...)` with row b's tokens from lens[b] on set to
    0 (right padding)."""
    width = int(max(lens))
    ids = random_tokens(seed, (len(lens), width), vocab)  # [B, W]
    return np.where(np.arange(width) < np.asarray(lens)[:, None], ids, 0)
