"""Batch-invariant numerics (DecodeConfig(invariant=True)), in bfloat16, block by block: a row's logits do not
depend on what shares its passes.

Each family's tiny model (random bfloat16 weights) runs, twice:
  - batched: 3 rows of different prompt lengths, prefilled together (right-padded), then a verify block of 4 tokens
    per row in one pass;
  - alone: each row prefilled by itself (no padding), then the same 4 tokens one pass each.
The logits at every block position must agree bit for bit. The families cover every block whose reduction order
could follow the pass: GQA, latent attention (absorbed), gated attention, gated DeltaNet (chunked prefill, then
recurrent), sigmoid-routed and softmax-routed experts, the MTP layer and the lm_head.

In the default mode the same comparison fails on this CPU (the block's own positions and the cache are attended in
separate sums, and a long prefill's projections take XLA's GEMM): `test_default_mode_depends_on_the_pass` shows it,
so the comparison can fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.config.model import MoeConfig
from mtp_jax.kernels.dispatch import lone_rows_exact, project
from mtp_jax.models.cache_attention import AttentionForm
from mtp_jax.models.hybrid_stack import RecurrentForm
from mtp_jax.ops.rowwise import row_sum
from mtp_jax.plan import shapes

pytestmark = pytest.mark.slow

PROMPT_LENS = (5, 13, 9)
BLOCK = 4
SLOTS = 256  # one attention chunk


def _softmax_moe_hybrid():
    moe = MoeConfig(num_experts=8, experts_per_token=2, expert_intermediate_size=32, scoring="softmax",
                    shared_intermediate_size=64)  # fmt: skip
    return shapes.qwen3_5_tiny().replace(family="qwen3_5_moe_text", moe=moe)


FAMILIES = {
    "gqa": shapes.tiny,
    "mla_sigmoid_moe": shapes.deepseek_v3_tiny,
    "gated_deltanet": shapes.qwen3_5_tiny,
    "gated_deltanet_softmax_moe": _softmax_moe_hybrid,
}


def _model(name: str):
    return mtp_jax.CausalLM(FAMILIES[name](), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def _tokens(vocab: int):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, vocab, n).astype(np.int32) for n in PROMPT_LENS]
    blocks = rng.integers(3, vocab, (len(PROMPT_LENS), BLOCK)).astype(np.int32)
    return prompts, blocks


@nnx.jit(static_argnames="invariant")
def _prefill(model, ids, lens, invariant):
    """Trunk over right-padded prompts ids [B, P] (lens [B]) into a fresh cache; returns it and an empty MTP cache
    (the MTP layer sees only the block)."""
    b, p = ids.shape
    positions = jnp.broadcast_to(jnp.arange(p), (b, p))
    attention = AttentionForm.INVARIANT if invariant else None
    _, cache = model.trunk(ids, positions, model.new_cache(b, SLOTS, attention), lengths=lens)
    return cache, model.new_mtp_cache(b, SLOTS, attention)


@nnx.jit(static_argnames="recurrent")
def _block_logits(model, caches, tokens, positions, recurrent):
    """Trunk logits [B, T, V] and MTP logits [B, T, V] over a block of tokens [B, T] at positions [B, T], and the
    (trunk, MTP) caches after it."""
    cache, mtp_cache = caches
    hidden, cache = model.trunk(tokens, positions, cache, recurrent=recurrent)
    _, normed, mtp_cache = model.mtp_step(hidden, tokens, positions, mtp_cache)
    return model.logits(hidden), model.draft_logits(normed), (cache, mtp_cache)


def _batched_and_alone(model, invariant: bool):
    """(logits of the batched run, of the rows alone): each a pair of [B, T, V] arrays (trunk, MTP)."""
    prompts, blocks = _tokens(model.config.vocab_size)
    width = max(PROMPT_LENS)
    ids = np.stack([np.pad(p, (0, width - len(p))) for p in prompts])
    lens = np.asarray(PROMPT_LENS, np.int32)
    cache = _prefill(model, jnp.asarray(ids), jnp.asarray(lens), invariant)
    positions = lens[:, None] + np.arange(BLOCK)
    batched = _block_logits(model, cache, jnp.asarray(blocks), jnp.asarray(positions), RecurrentForm.EVERY_STATE)[:2]
    alone = []
    copies = 2 if invariant and not lone_rows_exact() else 1  # a lone prompt as `generate` decodes it
    for row, prompt in enumerate(prompts):
        cache = _prefill(
            model, jnp.asarray([prompt] * copies), jnp.asarray([len(prompt)] * copies, np.int32), invariant
        )
        steps = []
        for t in range(BLOCK):
            token, position = blocks[[row] * copies, t : t + 1], positions[[row] * copies, t : t + 1]
            trunk, mtp, cache = _block_logits(
                model, cache, jnp.asarray(token), jnp.asarray(position), RecurrentForm.LAST_STATE
            )
            steps.append((trunk[0, 0], mtp[0, 0]))
        alone.append([jnp.stack(parts) for parts in zip(*steps, strict=True)])
    alone = [jnp.stack([row[i] for row in alone]) for i in range(2)]
    return [np.asarray(x) for x in batched], [np.asarray(x) for x in alone]


@pytest.mark.parametrize("name", FAMILIES)
def test_rows_alone_equal_rows_in_a_batch_and_a_verify_block(name):
    model = _model(name)
    batched, alone = _batched_and_alone(model, invariant=True)
    for what, got, expected in zip(("trunk", "MTP"), batched, alone, strict=True):
        assert np.isfinite(expected).all()
        differ = (got != expected).any(axis=-1)  # [B, T]
        assert not differ.any(), f"{name} {what} logits differ at (row, block position) {np.argwhere(differ)}"


def test_default_mode_depends_on_the_pass():
    """The same comparison in the default mode finds rows whose logits moved: the check above can fail."""
    batched, alone = _batched_and_alone(_model("gqa"), invariant=False)
    assert (batched[0] != alone[0]).any()
    np.testing.assert_allclose(batched[0], alone[0], atol=0.25)  # only the bits moved, not the model


def test_row_sums_and_projections_do_not_depend_on_the_number_of_rows():
    """The two primitives under the blocks: `row_sum` (norms, softmax totals) gives each row the same bits in a
    pass of 1, 2, 3, 8 or 64 rows, `project` (every projection) in a pass of 2, 3, 8 or 64, and of 1 where
    `lone_rows_exact` (with the CPU row kernel; without it invariant decoding never passes a single row: a lone
    prompt decodes beside its copy), and both agree with the plain sum and einsum."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(64, 576)), jnp.float32)
    sums = jax.jit(row_sum)
    full = np.asarray(sums(x))
    np.testing.assert_allclose(full, np.asarray(x).sum(-1), rtol=1e-5, atol=1e-4)
    weight = jnp.asarray(rng.normal(size=(576, 320)) / 24, jnp.bfloat16)
    rows = jnp.asarray(x[:, None], jnp.bfloat16)  # [R, 1, D]
    proj = jax.jit(lambda r: project("BTD,DF->BTF", r, weight))
    projected = np.asarray(proj(rows).astype(jnp.float32))
    expected = np.einsum("btd,df->btf", np.asarray(rows, np.float32), np.asarray(weight, np.float32))
    np.testing.assert_allclose(projected, expected, rtol=2e-2, atol=2e-2)
    for count in (1, 2, 3, 8):
        np.testing.assert_array_equal(np.asarray(sums(x[:count])), full[:count])
    for count in (1, 2, 3, 8) if lone_rows_exact() else (2, 3, 8):
        np.testing.assert_array_equal(np.asarray(proj(rows[:count]).astype(jnp.float32)), projected[:count])


def test_the_stage_by_stage_tool_finds_nothing_in_the_invariant_mode():
    """`python -m mtp_jax.invariance`'s comparison on a tiny GQA model: with invariant numerics, rows alone and in
    a batch agree at every stage of the prefill and of a decode step."""
    from mtp_jax.cli.invariance import compare

    model = _model("gqa")
    prompts = [list(p) for p in _tokens(model.config.vocab_size)[0]]
    clean = compare(model, prompts, invariant=True)
    assert clean["differing_rows_by_stage"] == {"prefill": {}, "step": {}}
    assert clean["first_differing_stage_by_row"]["step"] == [None] * len(prompts)
