"""`MtpRollout` against tunix's own vanilla rollout on tiny tunix models: greedy answers token for token, sampled
answers from the same distributions (a two-sample test), log-probabilities against tunix's
`compute_per_token_logps`, weight syncs that change what is generated and never touch the trainer's model, a head
refresh that wins back acceptance after the policy moved, and the RL bench's scoring of both heads on one policy's
answers."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="tunix comes with the `rl` extra; .ci/run tests it in an environment of its own")

from scipy.stats import chi2_contingency
from tunix.rl import common
from tunix.rl.rollout import base_rollout, vanilla_rollout

from mtp_jax.rl import tunix_rollout
from mtp_jax.rl.tunix_rollout import MtpRollout
from mtp_jax.runtime.errors import UserError
from mtp_jax.training.head_refresh import RefreshConfig, draft_agreement, rollout_batch
from tests.rl.tunix_support import CharTokenizer, predictable_head, tiny_tunix_model

PROMPTS = ["hello there", "what is 2+2?", "abc", "the quick brown fox jumps over the lazy dog"]  # the last: > 16
CACHE = 96


def rollout_config(temperature: float, tokens: int = 12, **changes) -> base_rollout.RolloutConfig:
    top_p = None if temperature == 0 else 1.0  # tunix's sampler is greedy only without top_p
    return base_rollout.RolloutConfig(max_tokens_to_generate=tokens, temperature=temperature, top_p=top_p,
                                      max_prompt_length=16, kv_cache_size=CACHE, return_logprobs=True,
                                      **changes)  # fmt: skip


def vanilla(model) -> vanilla_rollout.VanillaRollout:
    cfg = model.config
    cache = base_rollout.CacheConfig(cache_size=CACHE, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim)  # fmt: skip
    return vanilla_rollout.VanillaRollout(model, CharTokenizer(), cache)


def ours(model, head_noise: float = 0.02, **kwargs) -> MtpRollout:
    head = predictable_head(model, noise=head_noise)
    return MtpRollout(model, CharTokenizer(), None, rollout_config(0.0), head=head, num_draft=2, **kwargs)


@pytest.fixture(scope="module")
def policy():
    return tiny_tunix_model("llama3", seed=3, context_scale=0.3, logit_scale=32.0)


def test_greedy_rollouts_equal_tunix_s_token_for_token(policy):
    engine = ours(policy, slots=3)  # fewer slots than prompts: rows refill
    got = engine.generate(PROMPTS, rollout_config(0.0))
    expected = vanilla(policy).generate(PROMPTS, rollout_config(0.0))
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in expected.tokens]
    assert got.text == expected.text
    np.testing.assert_array_equal(got.left_padded_prompt_tokens, expected.left_padded_prompt_tokens)
    assert got.left_padded_prompt_tokens.shape == (4, 64)  # the long prompt's width, to a power of two, as tunix
    assert engine.last_stats["accepted"] > engine.last_stats["drafted"] // 2  # the drafts did the work


def completions(tokens: list[np.ndarray], width: int, pad: int) -> np.ndarray:
    out = np.full((len(tokens), width), pad, np.int32)
    for row, t in enumerate(tokens):
        out[row, : len(t)] = t
    return out


def test_log_probabilities_are_tunix_s_for_the_sampled_tokens(policy):
    engine = ours(policy, head_noise=0.3)
    config = rollout_config(0.8, seed=7)
    out = engine.generate(PROMPTS, config)
    answers = completions(out.tokens, 12, CharTokenizer().pad_id())
    prompts, answers = jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(answers)
    graphdef, state = nnx.split(policy)
    for temperature in (0.8, 1.0):
        reference = common.compute_per_token_logps(graphdef, state, prompt_tokens=prompts, completion_tokens=answers,
                                                   pad_id=2, eos_id=2, temperature=temperature)  # fmt: skip
        if temperature == 1.0:
            got = engine.get_per_token_logps(prompts, answers)
        else:
            got = [np.pad(row, (0, 12 - len(row))) for row in out.logprobs]
        for row, tokens in enumerate(out.tokens):
            n = len(tokens)
            np.testing.assert_allclose(np.asarray(got[row])[:n], np.asarray(reference[row])[:n], atol=1e-5)
    assert engine.last_stats["drafted"] > 0


def first_tokens(tokens: list[np.ndarray], count: int, eos: int) -> list[tuple[int, ...]]:
    """Each answer's first `count` tokens, EOS standing for those it did not reach."""
    return [tuple(t[:count].tolist()) + (eos,) * (count - len(t[:count])) for t in tokens]


def homogeneity_p(a: list, b: list) -> float:
    """Chi-squared test that two samples of categories come from one distribution (categories seen fewer than 10
    times in both together pooled)."""
    kinds = sorted(set(a) | set(b))
    table = np.array([[a.count(k) for k in kinds], [b.count(k) for k in kinds]])
    rare = table.sum(axis=0) < 10
    table = np.concatenate([table[:, ~rare], table[:, rare].sum(axis=1, keepdims=True)], axis=1)
    return float(chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_rollouts_come_from_tunix_s_distribution(policy, temperature):
    """2,000 answers to one prompt from each engine, their first two tokens compared (each alone and as a pair);
    the head drafts from a distribution of its own (noise 0.3), so drafts are rejected and resampled often."""
    prompts = ["abc"] * 2000
    config = rollout_config(temperature, tokens=2)
    engine = ours(policy, head_noise=0.3, slots=64)
    got = engine.generate(prompts, dataclasses.replace(config, seed=11)).tokens
    expected = vanilla(policy).generate(prompts, dataclasses.replace(config, seed=12)).tokens
    stats = engine.last_stats
    assert 0.1 < stats["accepted"] / stats["drafted"] < 0.9, stats  # both accepted and rejected drafts
    ours_pairs, theirs_pairs = first_tokens(got, 2, 2), first_tokens(expected, 2, 2)
    for part in (lambda p: p[0], lambda p: p[1], lambda p: p):
        p = homogeneity_p([part(x) for x in ours_pairs], [part(x) for x in theirs_pairs])
        assert p > 1e-3, p


def moved(model, seed: int = 5, scale: float = 0.6, amplify: float = 1.0):
    """A copy of tunix `model` with its MLPs' output and its lm_head moved by `scale` times their spread of random
    noise, and what its layers add to the residual stream multiplied by `amplify` (a policy after some training;
    amplified, no longer the near-bigram model its head was made for)."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    weights = [layer.mlp.down_proj.kernel for layer in copy.layers] + [copy.lm_head.w]
    for i, w in enumerate(weights):
        w[...] = w[...] + scale * jax.random.normal(jax.random.key(seed + i), w[...].shape) * jnp.std(w[...])
    for layer in copy.layers:
        for w in (layer.attn.o_proj.w, layer.mlp.down_proj.kernel):
            w[...] = w[...] * amplify
    return copy


@contextlib.contextmanager
def as_tunix_syncs_weights():
    """tunix's `sync_weights` on a CPU: no explicit host transfers either way."""
    with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
        yield


def test_a_weight_sync_changes_what_is_generated_and_leaves_the_trainer_s_model_alone(policy):
    engine = ours(policy)
    before = engine.generate(PROMPTS, rollout_config(0.0)).tokens
    trainer = moved(policy)
    kept = jax.tree.map(np.asarray, nnx.state(trainer))
    with as_tunix_syncs_weights():
        engine.update_params(nnx.state(trainer, nnx.Param), (nnx.Param,))
    after = engine.generate(PROMPTS, rollout_config(0.0)).tokens
    assert [t.tolist() for t in after] != [t.tolist() for t in before]
    expected = vanilla(trainer).generate(PROMPTS, rollout_config(0.0)).tokens
    assert [t.tolist() for t in after] == [t.tolist() for t in expected]
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(trainer)), kept)


def first_draft_acceptance(engine: MtpRollout, prompts: list[str]) -> float:
    engine.generate(prompts, rollout_config(0.0, tokens=24))
    stats = engine.last_stats
    return stats["accepted_at"][0] / stats["reached"][0]


def test_a_refreshed_head_wins_back_the_acceptance_a_frozen_one_loses(policy):
    prompts = [f"{a} {b}" for a in ("one", "two", "three", "four") for b in ("cat", "dog", "sun", "sea")]
    trainer = moved(policy, amplify=8.0)
    frozen = ours(policy)
    start = first_draft_acceptance(frozen, prompts)
    with as_tunix_syncs_weights():
        frozen.update_params(nnx.state(trainer, nnx.Param))
    frozen_after = first_draft_acceptance(frozen, prompts)

    refreshed = ours(policy, refresh=RefreshConfig(num_steps=2, learning_rate=3e-3), refresh_steps=40)
    refreshed.generate(prompts, rollout_config(1.0, tokens=24, seed=3))  # the rollouts a refresh learns from
    with as_tunix_syncs_weights():
        refreshed.update_params(nnx.state(trainer, nnx.Param))
    refreshed_after = first_draft_acceptance(refreshed, prompts)
    kept, other = (dict(nnx.to_flat_state(nnx.state(e.decode_model))) for e in (frozen, refreshed))
    for path, value in kept.items():  # the refresh moved the head alone
        same = np.array_equal(np.asarray(value.get_value()), np.asarray(other[path].get_value()))
        assert same == (path[0] != "mtp"), path
    assert refreshed.seconds["refresh"] > 0
    assert frozen_after < start - 0.1 and refreshed_after > frozen_after + 0.1, (start, frozen_after, refreshed_after)


def test_a_refresh_reads_as_many_rollouts_as_it_is_given(policy, monkeypatch):
    prompts = [f"{a} {b}" for a in ("one", "two", "three", "four") for b in ("cat", "dog", "sun", "sea")]
    read = []

    def recording(model, tokens, lengths, starts):
        read.append((np.asarray(tokens), np.asarray(lengths), np.asarray(starts)))
        return rollout_batch(model, tokens, lengths, starts)

    monkeypatch.setattr(tunix_rollout, "rollout_batch", recording)
    trainer = moved(policy, amplify=2.0)
    for rows, expected in ((3, 3), (40, len(prompts))):
        engine = ours(policy, refresh=RefreshConfig(num_steps=2), refresh_rows=rows)
        answers = engine.generate(prompts, rollout_config(1.0, tokens=24, seed=3)).tokens
        with as_tunix_syncs_weights():
            engine.update_params(nnx.state(trainer, nnx.Param))
        engine.generate(prompts[:1], rollout_config(0.0))
        tokens, lengths, starts = read.pop()
        assert len(tokens) == expected and tokens.shape[1] % 64 == 0 and tokens.shape[1] - 64 < lengths.max()
        drawn = Counter(tuple(row[start:length]) for row, start, length in zip(tokens, starts, lengths, strict=True))
        assert drawn <= Counter(tuple(a.tolist()) for a in answers)  # rollouts' own rows, none read twice
    with pytest.raises(UserError, match="refresh_rows"):
        ours(policy, refresh=RefreshConfig(), refresh_rows=0)


def test_the_rl_bench_scores_the_drafting_and_the_shipped_head_on_the_same_rollouts(policy):
    from mtp_jax.bench import rl_rollouts

    prompts = [f"{a} {b}" for a in ("one", "two", "three", "four") for b in ("cat", "dog", "sun", "sea")]
    trainer = moved(policy, amplify=8.0)
    engine = rl_rollouts.MeasuredRollout(policy, CharTokenizer(), None, rollout_config(0.0), num_draft=2,
                                         head=predictable_head(policy, noise=0.02), score_rows=len(prompts),
                                         refresh=RefreshConfig(num_steps=2, learning_rate=3e-3),
                                         refresh_steps=40)  # fmt: skip
    rl_rollouts.RECORDS.clear()
    engine.generate(prompts, rollout_config(1.0, tokens=24, seed=3))
    with as_tunix_syncs_weights():
        engine.update_params(nnx.state(trainer, nnx.Param))
    engine.generate(prompts, rollout_config(1.0, tokens=24, seed=4))  # drafted by the refreshed head
    before, after = rl_rollouts.RECORDS

    # before any refresh both are the shipped head; after it, the shipped head is scored as a frozen engine has it
    assert before["head_expected_acceptance"] == before["shipped_head_expected_acceptance"]
    frozen = ours(policy)
    with as_tunix_syncs_weights():
        frozen.update_params(nnx.state(trainer, nnx.Param))
    batch = rollout_batch(frozen.decode_model, *engine.last_rollouts)
    shipped = draft_agreement(frozen.decode_model, batch)
    np.testing.assert_allclose(after["shipped_head_expected_acceptance"], shipped["expected"][0], rtol=1e-5)
    np.testing.assert_allclose(after["shipped_head_argmax_acceptance"], shipped["argmax"][0], rtol=1e-6)
    assert after["head_expected_acceptance"] > after["shipped_head_expected_acceptance"] + 0.05, after  # 0.88, 0.78
    assert after["score_seconds"] > 0 and 0 < after["first_draft_acceptance"] <= 1


def test_the_rl_bench_times_the_last_policy_with_drafts_and_without(policy):
    from mtp_jax.bench import rl_rollouts

    prompts = [f"{a} {b}" for a in ("one", "two", "three", "four") for b in ("cat", "dog", "sun", "sea")]
    engine = ours(policy)
    end = rl_rollouts.compare_with_plain(engine, CharTokenizer(), prompts, rollout_config(1.0, tokens=24), 2, 2)
    assert (end["rows"], end["repeats"]) == (len(prompts), 2)
    assert end["speedup"] == pytest.approx(end["drafting_tokens_per_second"] / end["plain_tokens_per_second"])
    assert 0.3 < end["first_draft_acceptance"] <= 1 and end["tokens_per_round"] > 1.3, end  # the near-bigram head
