"""tunix's GRPO end to end with `MtpRollout` as its rollout engine, on a tiny tunix Llama3 on CPU: the policy trains,
every weight sync reaches the engine (its trunk is the trained policy's), and the head is refreshed on the way."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="tunix comes with the `rl` extra; .ci/run tests it in an environment of its own")

from tunix.rl import rl_cluster as rlc
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import metrics_logger

from mtp_jax.rl.tunix_models import causal_lm_from_tunix
from mtp_jax.rl.tunix_rollout import MtpRollout
from mtp_jax.training.head_refresh import RefreshConfig
from tests.rl.tunix_support import CharTokenizer, predictable_head, tiny_tunix_model

STEPS = 4


def count_of_a(prompts, completions, **kwargs) -> list[float]:
    """A reward a tiny random policy can learn: how many "a"s its answer has."""
    return [float(c.count("a")) for c in completions]


def test_grpo_trains_the_policy_through_mtp_rollouts(tmp_path):
    policy = tiny_tunix_model("llama3", seed=3, context_scale=0.3, logit_scale=32.0)
    reference = tiny_tunix_model("llama3", seed=3, context_scale=0.3, logit_scale=32.0)
    start = jax.tree.map(np.asarray, nnx.state(policy, nnx.Param))
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    engine = functools.partial(MtpRollout, head=predictable_head(policy, noise=0.3), num_draft=2, slots=8,
                               refresh=RefreshConfig(num_steps=2, learning_rate=1e-3))  # fmt: skip
    logging = metrics_logger.MetricsLoggerOptions(log_dir=str(tmp_path), flush_every_n_steps=1)
    training = rlc.RLTrainingConfig(
        actor_optimizer=optax.adam(3e-3), eval_every_n_steps=100, max_steps=STEPS, metrics_logging_options=logging
    )
    rollouts = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, temperature=1.0, max_prompt_length=16, kv_cache_size=64
    )
    meshes = {rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh}
    config = rlc.ClusterConfig(
        role_to_mesh=meshes, rollout_engine=engine, training_config=training, rollout_config=rollouts
    )
    cluster = rlc.RLCluster(actor=policy, reference=reference, tokenizer=CharTokenizer(), cluster_config=config)
    algorithm = grpo_learner.GRPOConfig(num_generations=4, num_iterations=1, beta=0.04)
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algorithm, reward_fns=[count_of_a])
    learner.train([{"prompts": np.array(["abc", "hello", "xyz", "count"])} for _ in range(STEPS)])

    rollout = cluster.rollout
    assert isinstance(rollout, MtpRollout)
    losses = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", metrics_logger.Mode.TRAIN)
    assert len(losses) == STEPS and np.all(np.isfinite(losses)) and np.ptp(losses) > 0, losses
    trained = cluster.actor_trainer.model
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), start, nnx.state(trained, nnx.Param))
    assert any(jax.tree.leaves(moved))
    expected = causal_lm_from_tunix(trained, (2,), 64)  # the engine decodes the policy as of the last sync
    ours = dict(nnx.to_flat_state(nnx.state(rollout.decode_model)))
    for path, value in nnx.to_flat_state(nnx.state(expected)):
        np.testing.assert_array_equal(np.asarray(ours[path].get_value()), np.asarray(value.get_value()), str(path))
    assert rollout.seconds["refresh"] > 0 and rollout.last_refresh["loss"] > 0
    assert rollout.last_stats["drafted"] > 0 and rollout.last_stats["accepted"] > 0


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--generations", "1"], ["--lr", "0"], ["--score-rows", "-1"], ["--compare-repeats", "-1"]],
)
def test_the_rl_bench_refuses_bad_settings_in_one_line(argv, capsys, tmp_path):
    from mtp_jax.bench.rl_rollouts import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("python -m mtp_jax.bench.rl_rollouts: error: --")
    assert not (tmp_path / "out.jsonl").exists()
