"""`Engine`: slots that refill. Every request's tokens equal that prompt's decoding by `generate` (greedy under
batch-invariant numerics, whatever the arrival order, the slot, the rows beside it and when it joined), sampled
streams follow a request's seed and not its slot, cancelled rows free their slot, bad requests are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.decode import memory
from mtp_jax.decode.engine import Engine, Request
from mtp_jax.decode.prefill import PromptPart, prefill, prefill_part
from mtp_jax.kernels import traced_plan
from mtp_jax.models.cache_attention import AttentionForm
from mtp_jax.runtime import compile_cache
from tests.support.hybrid_models import predictable_hybrid_model
from tests.support.prompts import padded_prompts
from tests.support.tiny_models import predictable_model, predictable_moe_model

LENS = np.array([1, 7, 4, 10, 3, 9, 2, 12, 5, 6], np.int32)
PROMPTS = padded_prompts(0, LENS, 24)
BUDGETS = [24, 9, 24, 17, 24, 5, 20, 24, 13, 24]  # a request's max_tokens
MAX_NEW = max(BUDGETS)
SLOTS = 3
MODELS = {
    "gqa": lambda: predictable_model("deepseek", 11),
    "mla_moe": lambda: predictable_moe_model("deepseek_v3", seed=2),
    "hybrid": lambda: predictable_hybrid_model(seed=3),
}


def run_engine(engine: Engine, requests: list[Request], order: list[int], late: int = 0) -> dict:
    """Each request's (tokens, finish reason), submitting them in `order`, the last `late` of them only once the
    first are running (they join rows already mid-answer)."""
    early, delayed = order[: len(order) - late], order[len(order) - late :]
    ids = {engine.submit(requests[i]): i for i in early}
    tokens, reasons, steps = {i: [] for i in order}, {}, 0
    while engine.busy or delayed:
        if steps == 2:
            ids.update({engine.submit(requests[i]): i for i in delayed})
            delayed = []
        for update in engine.step():
            tokens[ids[update.request_id]] += update.tokens
            if update.finished:
                reasons[ids[update.request_id]] = update.finish_reason
        steps += 1
    return {i: (tokens[i], reasons[i]) for i in order}


def reference(model, cfg: mtp_jax.DecodeConfig, keys=None) -> dict:
    """Every prompt decoded by one `generate` call (each row as alone: batch-invariant numerics, or the predictable
    models' wide margins), cut at each request's budget."""
    keys = jax.random.split(jax.random.key(0), len(LENS)) if keys is None else keys
    out = jax.tree.map(np.asarray, mtp_jax.generate(model, PROMPTS, LENS, keys, cfg))
    expected = {}
    for i, budget in enumerate(BUDGETS):
        tokens = out.tokens[i, : min(int(out.lengths[i]), budget)].tolist()
        by_eos = bool(out.finished_by_eos[i]) and int(out.lengths[i]) <= budget
        expected[i] = (tokens, "eos" if by_eos else "length")
    return expected


def requests(**settings) -> list[Request]:
    return [Request(PROMPTS[i, : LENS[i]].tolist(), BUDGETS[i], **settings) for i in range(len(LENS))]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MODELS))
def test_greedy_rows_equal_generate_whatever_their_slot(family):
    """Ten prompts through three slots, submitted out of order, three joining rows already mid-answer, rows ending at
    EOS mid-round and at their own budgets: each request's tokens are `generate`'s."""
    model = MODELS[family]()
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=MAX_NEW, invariant=True)
    expected = reference(model, cfg)
    if family == "gqa":  # (the others' prompts end no row at EOS)
        assert {reason for _, reason in expected.values()} == {"eos", "length"}
    engine = Engine(model, cfg, slots=SLOTS, max_len=12 + MAX_NEW, rounds_per_piece=3)
    got = run_engine(engine, requests(), [3, 0, 7, 1, 9, 2, 8, 4, 6, 5], late=3)
    assert got == expected
    stats = engine.stats()
    assert stats["accepted"] > 0
    assert stats["rounds"] < sum(len(t) for t, _ in expected.values()) / SLOTS  # rows shared the rounds


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gqa", "hybrid"])
def test_long_prompts_prefill_in_chunks_between_rounds(family):
    """Prompts over 4 tokens prefilled 4 at a time (a chunk a step, the other rows' rounds running between chunks;
    DeltaNet states carried from chunk to chunk): `generate`'s tokens. A long prompt cancelled mid-prefill frees its
    slot."""
    model = MODELS[family]()
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=MAX_NEW, invariant=True)
    engine = Engine(model, cfg, slots=SLOTS, max_len=12 + MAX_NEW, rounds_per_piece=3, prefill_chunk=4)
    cancelled = engine.submit(Request(PROMPTS[7, : LENS[7]].tolist(), 4))
    engine.step()
    assert engine.waiting == 1 and engine.running == 0 and engine.cancel(cancelled)
    assert run_engine(engine, requests(), [3, 0, 7, 1, 9, 2, 8, 4, 6, 5], late=3) == reference(model, cfg)
    assert engine.chunks_prefilled == 1 + sum((n - 1) // 4 for n in LENS)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gqa", "hybrid"])
def test_a_prompt_prefilled_in_chunks_holds_the_caches_of_one_prefill(family):
    """Chunks of 4, 4 and 3 tokens (`prefill_part` twice, then `prefill` after them) leave the trunk cache, the MTP
    cache and the loop state of one prefill over the 11 tokens, in the slots the prompt holds (to float32 rounding:
    batch-invariant numerics make a row's sums independent of the other rows, not of the block's width)."""
    model = MODELS[family]()
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=8, invariant=True)
    ids = jnp.asarray(np.tile(PROMPTS[7, :11], (2, 1)))  # [2, 11]: two rows (a lone row sums otherwise)
    slots, form = 256, AttentionForm.INVARIANT

    def whole():
        with traced_plan.tracing(traced_plan.resolve(invariant=True)):
            return prefill(model, cfg, None, jnp.zeros((0,), jnp.int32), ids, jnp.full((2,), 11), keys, slots,
                           attention=form)  # fmt: skip

    def chunked():
        with traced_plan.tracing(traced_plan.resolve(invariant=True)):
            part = PromptPart.empty(model, cfg, 2, slots, form)
            for start in (0, 4):
                part = prefill_part(model, cfg, ids[:, start : start + 4], ids[:, start + 4], part)
            return prefill(model, cfg, None, jnp.zeros((0,), jnp.int32), ids[:, 8:], jnp.full((2,), 3), keys, slots,
                           attention=form, part=part)  # fmt: skip

    keys = jax.random.split(jax.random.key(0), 2)
    one, parts = (jax.jit(build)().replace(row_keys=None) for build in (whole, chunked))
    held = lambda x: x[:, :, :11] if x.ndim >= 3 and x.shape[2] == slots else x  # [L, B, S, ...]: the prompt's slots
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(parts), strict=True):
        np.testing.assert_allclose(np.asarray(held(a)), np.asarray(held(b)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["plain", "adaptive", "tree", "adaptive_tree"])
def test_every_kind_of_round_refills(drafting):
    """Plain steps, adaptive rounds (which run inner loops of one kind of round: they stop too as a row finishes),
    draft trees, and adaptive rounds among chains and a tree through the engine: `generate`'s tokens."""
    model = MODELS["gqa"]()
    settings = {"plain": dict(num_draft=0, invariant=True), "adaptive": dict(num_draft=3, adaptive=True,
                invariant=True), "tree": dict(num_draft=2, tree=4, tree_width=2),
                "adaptive_tree": dict(num_draft=2, tree=4, tree_width=2, adaptive=True,
                                      round_costs=(1.0, 1.1, 1.2, 1.2))}[drafting]  # fmt: skip
    cfg = mtp_jax.DecodeConfig(max_new_tokens=MAX_NEW, **settings)
    engine = Engine(model, cfg, slots=SLOTS, max_len=12 + MAX_NEW, rounds_per_piece=4)
    assert run_engine(engine, requests(), list(range(len(LENS))), late=2) == reference(model, cfg)
    if drafting == "adaptive_tree":
        assert int(mtp_jax.generate(model, PROMPTS, LENS, jax.random.key(0), cfg).stats.tree_rounds) > 0


@pytest.mark.slow
def test_a_sampled_stream_follows_its_seed_not_its_slot():
    """Sampled rows: the same tokens through 3 slots in one order, through 4 in another, and from `generate` with
    the request's key, for every request (its draws are counted by its own rounds)."""
    model = MODELS["gqa"]()
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=MAX_NEW, invariant=True)
    settings = dict(temperature=0.9, top_k=6)
    batch = [Request(r.prompt_ids, r.max_tokens, seed=100 + i, **settings) for i, r in enumerate(requests())]
    first = run_engine(Engine(model, cfg, slots=3, max_len=40), batch, list(range(len(LENS))))
    second = run_engine(Engine(model, cfg, slots=4, max_len=48), batch, list(reversed(range(len(LENS)))), late=4)
    assert first == second
    keys = jnp.stack([jax.random.key(100 + i) for i in range(len(LENS))])
    sampled = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=MAX_NEW, invariant=True, **settings)
    expected = reference(model, sampled, keys)
    assert first == expected
    greedy = reference(model, cfg)
    assert sum(first[i][0] != greedy[i][0] for i in first) >= 5  # the streams sampled


@pytest.mark.slow
def test_a_cancelled_request_frees_its_slot():
    model = MODELS["gqa"]()
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=MAX_NEW, invariant=True)
    engine = Engine(model, cfg, slots=2, max_len=40, rounds_per_piece=2)
    batch = requests()
    running, waiting = engine.submit(batch[0]), engine.submit(batch[1])
    queued, last = engine.submit(batch[2]), engine.submit(batch[3])
    assert engine.cancel(queued) and not engine.cancel(12345)
    tokens, reasons = {running: [], waiting: [], last: []}, {}
    first = engine.step()
    assert engine.running == 2 and engine.waiting == 1
    assert engine.cancel(running)
    while engine.busy:
        for update in first or engine.step():
            tokens[update.request_id] += update.tokens
            reasons[update.request_id] = update.finish_reason
        first = None
    expected = reference(model, cfg)
    assert reasons[running] == "cancelled" and tokens[running] == expected[0][0][: len(tokens[running])]
    assert (tokens[waiting], reasons[waiting]) == expected[1]
    assert (tokens[last], reasons[last]) == expected[3]  # it took the cancelled row's slot
    assert not engine.cancel(running)


@pytest.mark.slow
def test_a_warmed_engine_compiles_nothing_more_and_keeps_its_rows():
    """`warm` mid-run (two rows running) leaves their tokens as they were, and afterwards no request compiles anything:
    greedy then sampled ones, joining one to three at once, short prompts and long ones prefilled in chunks."""
    model = MODELS["gqa"]()
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=MAX_NEW, invariant=True)
    engine = Engine(model, cfg, slots=SLOTS, max_len=12 + MAX_NEW, rounds_per_piece=3, prefill_chunk=8)
    batch = requests()
    ids = {engine.submit(batch[i]): i for i in (3, 0)}
    tokens = {i: [] for i in range(len(batch))}
    for update in engine.step():
        tokens[ids[update.request_id]] += update.tokens
    # greedy and sampled: inserts of 2 and 4 rows (invariant: pairs) at width 16, and rounds; the chunk programs; a
    # last chunk at width 16, or 12 and 4 where it ends the slot's 36 positions after 24 or 32 tokens
    assert engine.warm(sampled=True) == 2 * (2 * 1 + 1) + 2 + 2 * 3
    before = compile_cache.compile_seconds()
    ids.update({engine.submit(batch[i]): i for i in range(len(batch)) if i not in (3, 0)})
    while engine.busy:
        for update in engine.step():
            tokens[ids[update.request_id]] += update.tokens
    sampled = [engine.submit(Request(r.prompt_ids, 6, temperature=1.0, seed=i)) for i, r in enumerate(batch[:5])]
    while engine.busy:
        engine.step()
    assert compile_cache.compile_seconds() == before
    expected = reference(model, cfg)
    assert {i: t for i, t in tokens.items()} == {i: t for i, (t, _) in expected.items()}
    assert engine.chunks_prefilled >= 3 and len(sampled) == 5


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request([], 4), "empty"),
        (Request([1, 2, 99], 4), r"token ids must be integers in \[0, 24\)"),
        (Request([1, 2], 0), "max_tokens must be an integer >= 1"),
        (Request([1] * 30, 12), "take 42 positions; a slot holds 40"),
        (Request([1, 2], 4, temperature=-1.0), "temperature must be >= 0"),
        (Request([1, 2], 4, top_p=0.0), r"top_p in \(0, 1\]"),
    ],
)
def test_bad_requests_are_refused(request_, message):
    engine = Engine(MODELS["gqa"](), mtp_jax.DecodeConfig(num_draft=1), slots=2, max_len=40)
    with pytest.raises(ValueError, match=message):
        engine.submit(request_)
    assert not engine.busy


@pytest.mark.parametrize("slots, max_len, message", [(0, 40, "slots"), (2, 1, "max_len"), (2, 10**6, "max_len")])
def test_bad_engine_settings_are_refused(slots, max_len, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODELS["gqa"](), mtp_jax.DecodeConfig(num_draft=1), slots=slots, max_len=max_len)


def test_slots_that_cannot_fit_are_refused_before_anything_is_allocated(monkeypatch):
    model = MODELS["gqa"]()
    params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    monkeypatch.setattr(memory, "memory_capacity", lambda model: (params + 2**20, "a small device"))
    Engine(model, mtp_jax.DecodeConfig(num_draft=1), slots=4, max_len=40)  # well under a MiB of caches
    with pytest.raises(
        ValueError,
        match=r"^64 slots of 40 positions: the slots' caches and state \(.* GiB\) and the "
        r"parameters \(.* GiB\) need .* GiB, more than the .* GiB of a small device$",
    ):
        Engine(model, mtp_jax.DecodeConfig(num_draft=1), slots=64, max_len=40)
