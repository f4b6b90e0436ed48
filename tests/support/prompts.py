"""Random token ids for tests: plain, and right-padded prompts of different lengths (no torch needed)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import mtp_jax


def random_tokens(seed: int, shape: tuple[int, ...], vocab: int) -> np.ndarray:
    """Token ids uniform in [0, vocab), int32, of `shape` (e.g. [B, T]), from numpy's generator seeded `seed`."""
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def padded_prompts(seed: int, lens: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray:
    """ids [B, max(lens)] int32, B = len(lens): `random_tokens(seed, ...)` with row b's tokens from lens[b] on set to
    0 (right padding)."""
    width = int(max(lens))
    ids = random_tokens(seed, (len(lens), width), vocab)  # [B, W]
    return np.where(np.arange(width) < np.asarray(lens)[:, None], ids, 0)


def invariant_greedy(model, prompts: Sequence[np.ndarray], num_draft: int, max_new_tokens: int) -> list[np.ndarray]:
    """Each prompt's greedy tokens from one `generate` call over them right-padded, under batch-invariant numerics."""
    width = max(len(p) for p in prompts)
    ids = np.stack([np.pad(p, (0, width - len(p))) for p in prompts]).astype(np.int32)
    lens = np.asarray([len(p) for p in prompts], np.int32)
    cfg = mtp_jax.DecodeConfig(num_draft=num_draft, max_new_tokens=max_new_tokens, invariant=True)
    out = mtp_jax.generate(model, jnp.asarray(ids), jnp.asarray(lens), jax.random.key(0), cfg)
    return [np.asarray(out.tokens[row, : int(out.lengths[row])]) for row in range(len(prompts))]


# Four rows of mixed lengths over the tiny models' 24-token vocabulary, right-padded: with the predictable models'
# seeds the lossless and adaptive decoding tests pick, a row stops at EOS mid-batch and drafts are accepted.
MIXED_LENS = np.array([1, 7, 4, 10], np.int32)
MIXED_PROMPTS = padded_prompts(0, MIXED_LENS, 24)
