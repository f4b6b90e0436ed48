"""A check shared by the parity tests: blocks decoded over a cache of two attention chunks, against transformers."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import torch

from mtp_jax.models.cache_attention import ATTENTION_CHUNK, AttentionForm

STARTS = (290, 100)  # row 0's block past the first chunk; row 1's over slots 100..289 of stale prefill
BLOCK = 10


def check_logits_after_a_long_cache(hf, model, ids: np.ndarray) -> None:
    """ids [2, 300]: a 290-token prefill of both rows into a cache of two chunks (the chunked pass), then row 0's
    block at 290 and row 1's at 100 (its slots 100..289 are stale, hidden by rollback by length); each against
    transformers' logits over that row's whole sequence."""
    slots, prefix = 2 * ATTENTION_CHUNK, max(STARTS)
    assert ids.shape == (2, prefix + BLOCK)
    cache = model.new_cache(2, slots, AttentionForm.CHUNKED)
    _, cache = model.trunk(ids[:, :prefix], jnp.broadcast_to(jnp.arange(prefix), (2, prefix)), cache)
    positions = np.asarray(STARTS)[:, None] + np.arange(BLOCK)  # [2, BLOCK]
    hidden, _ = model.trunk(np.take_along_axis(ids, positions, axis=1), positions, cache)
    for row, start in enumerate(STARTS):
        with torch.no_grad():
            reference = hf(torch.from_numpy(ids[row : row + 1, : start + BLOCK]).long()).logits[0, start:]
        chex.assert_trees_all_close(model.logits(hidden[row]), reference.float().numpy(), atol=1e-4, rtol=1e-4)
