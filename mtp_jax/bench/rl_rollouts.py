"""`python -m mtp_jax.bench.rl_rollouts`: tunix's GRPO on the default model (exported to tunix's Llama3), its
rollouts through `MtpRollout` with the shipped head frozen or refreshed at each weight sync, or plain (no drafts);
per RL step, the rollouts' first-draft acceptance, tokens/s and the refresh's cost, as JSON lines. Each step also
scores, teacher-forced on a few of its own rollouts under the policy that sampled them, both the head that drafted
them and the shipped head as it was before any refresh: the two heads compared on one policy's answers. At the end
of a run with drafts, the last policy's rollouts with the head's drafts and without are timed alternately on the same
prompts (`compare_with_plain`), written as one more JSON line ({"mode", "end_of_run": {...}}).

The task has a checkable answer: "What is A times B?", asked for a final "Answer: N" line; the reward is 1 for the
right product on that line, 0.5 for the right product elsewhere in the answer, 0.1 for the line with another
number (a 135M model rarely keeps the format at first). Needs the `rl` extra (tunix).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from transformers import AutoTokenizer
from tunix.models.llama3 import model as llama3
from tunix.rl import rl_cluster as rlc
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import metrics_logger

import mtp_jax
from mtp_jax.loading.default_conversion import cached_folder
from mtp_jax.loading.default_model import default_gguf_path
from mtp_jax.loading.heads import DEFAULT_HEAD
from mtp_jax.rl.tunix_export import tunix_model_from_causal_lm
from mtp_jax.rl.tunix_rollout import MtpRollout, sample_rows
from mtp_jax.training.head_refresh import RefreshConfig, draft_agreement, rollout_batch, with_head
from mtp_jax.training.head_training import split_trainable

QUESTION = "What is {a} times {b}? Think briefly, then end with a line 'Answer: N'."
ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def products(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(2, 30), rng.randint(2, 12)) for _ in range(count)]


MEAN_REWARDS: list[float] = []  # per call of `reward`: one a step
RECORDS: list[dict] = []  # per rollout (`MeasuredRollout.generate`): one a step
STEP_LISTENERS: list = []  # called with each step's finished record (its rollouts, then its reward)
STEP_ENDS: list[float] = []  # perf_counter at the start of the run, then at each step's reward


def reward(prompts, completions, **kwargs) -> list[float]:
    """1 for the right product on an "Answer: N" line, 0.5 for it elsewhere, 0.1 for the line with another number."""
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        a, b = (int(x) for x in re.findall(r"What is (\d+) times (\d+)", prompt)[0])
        found = ANSWER.findall(completion)
        if found and int(found[-1]) == a * b:
            scores.append(1.0)
        elif str(a * b) in re.findall(r"-?\d+", completion):
            scores.append(0.5)
        else:
            scores.append(0.1 if found else 0.0)
    MEAN_REWARDS.append(float(np.mean(scores)))
    STEP_ENDS.append(time.perf_counter())
    step = len(MEAN_REWARDS) - 1
    if step < len(RECORDS):
        scoring = RECORDS[step].get("score_seconds", 0.0)  # the bench's own measurement, not the RL step's work
        RECORDS[step]["step_seconds"] = STEP_ENDS[-1] - STEP_ENDS[-2] - scoring  # reward to reward: the RL step
        RECORDS[step]["live_array_bytes"] = sum(x.nbytes for x in jax.live_arrays())  # what the process holds
        RECORDS[step]["rss_bytes"] = resident_bytes()
        for listener in STEP_LISTENERS:
            listener({"step": step, "mean_reward": MEAN_REWARDS[step], **RECORDS[step]})
    return scores


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MeasuredRollout(MtpRollout):
    """MtpRollout that records, per `generate`, its seconds, the refresh's seconds before it, the drafts, and both
    heads' agreement with the policy on `score_rows` of its rollouts (`score_heads`; 0: none)."""

    def __init__(self, *args, score_rows: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        self.score_rows = score_rows
        self.score_draws = np.random.default_rng(1)  # which rollouts are scored
        self.shipped_head = split_trainable(self.decode_model)[1]  # the head as loaded, before any refresh

    def generate(self, prompts, rollout_config, **kwargs):
        refresh_before, start = self.seconds["refresh"], time.perf_counter()
        out = super().generate(prompts, rollout_config, **kwargs)
        wall = time.perf_counter() - start
        refresh = self.seconds["refresh"] - refresh_before
        stats, tokens = self.last_stats, sum(len(t) for t in out.tokens)
        reached = stats["reached"][0] if stats["reached"] else 0
        RECORDS.append({
            "rollout_seconds": wall - refresh, "refresh_seconds": refresh, "tokens": tokens,
            "tokens_per_second": tokens / max(wall - refresh, 1e-9),
            "first_draft_acceptance": stats["accepted_at"][0] / reached if reached else None,
            "tokens_per_round": stats["emitted"] / max(stats["row_rounds"], 1),
            **(self.score_heads() if self.score_rows else {}),
        })  # fmt: skip
        return out

    def score_heads(self) -> dict:
        """Teacher-forced on `score_rows` of the last rollouts, under the trunk that sampled them: the first draft's
        expected acceptance at temperature 1 and its argmax agreement (`draft_agreement`), for the head that drafted
        them and for the shipped head, with the seconds this took (left out of the step's)."""
        start = time.perf_counter()
        model = self.decode_model
        batch = rollout_batch(model, *sample_rows(self.last_rollouts, self.score_rows, self.score_draws))
        heads = {"head": model, "shipped_head": with_head(model, self.shipped_head)}
        record = {}
        for name, scored in heads.items():
            agreement = draft_agreement(scored, batch)
            record[f"{name}_expected_acceptance"] = agreement["expected"][0]
            record[f"{name}_argmax_acceptance"] = agreement["argmax"][0]
        return {**record, "score_seconds": time.perf_counter() - start}


def arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.bench.rl_rollouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["frozen", "refresh", "plain"], default="refresh")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft", type=int, default=2)
    parser.add_argument("--refresh-steps", type=int, default=1)
    parser.add_argument("--refresh-rows", type=int, default=4, help="rollouts a refresh reads (of those of a step)")
    parser.add_argument("--score-rows", type=int, default=8,
                        help="rollouts a step scores both heads on, teacher-forced (0: no scoring)")  # fmt: skip
    parser.add_argument("--compare-repeats", type=int, default=3,
                        help="at the end, timed rollouts of the last policy with drafts and without, each this many "
                             "times (0: none)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--out", required=True, help="JSON lines, one per RL step, each written as the step ends")
    args = parser.parse_args(argv)
    counts = ("steps", "prompts_per_step", "max_tokens", "refresh_steps", "refresh_rows")
    for name in (n for n in counts if getattr(args, n) < 1):
        parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.generations < 2 or args.num_draft < 1 or min(args.score_rows, args.compare_repeats) < 0 or args.lr <= 0:
        parser.error("--generations must be >= 2 (GRPO compares answers), --num-draft >= 1, --score-rows and "
                     "--compare-repeats >= 0, and --lr > 0")  # fmt: skip
    return args


def run(
    mode: str,
    steps: int,
    prompts_per_step: int = 4,
    generations: int = 4,
    max_tokens: int = 64,
    num_draft: int = 2,
    refresh_steps: int = 1,
    refresh_rows: int = 4,
    lr: float = 3e-6,
    on_step=None,
    score_rows: int = 8,
    compare_repeats: int = 0,
) -> list[dict]:
    """`steps` GRPO steps on the default model with rollouts of `mode` ("refresh", "frozen" or "plain"): one record
    a step (its rollouts' first-draft acceptance, tokens a round, tokens/s, the refresh's seconds, mean reward, the
    step's seconds from the last step's reward to its own, less the scoring's: the first holds the set-up, the bytes of
    the arrays alive and the process's resident memory at its end; both heads' scores on `score_rows` of its
    rollouts, `MeasuredRollout.score_heads`), each also passed to `on_step` as the step ends; with drafts and
    `compare_repeats`, `compare_with_plain`'s record of the last policy is passed to `on_step` last."""
    RECORDS.clear()
    MEAN_REWARDS.clear()
    STEP_ENDS[:] = [time.perf_counter()]
    model, _ = mtp_jax.load(dtype=jnp.float32, weights="bfloat16", activations="float", default_head=False)
    # transformers' tokenizer (what tunix's adapter reads), from the default model's converted folder
    tokenizer = AutoTokenizer.from_pretrained(cached_folder(default_gguf_path(), jnp.float32, keep_blocks=False))
    llama3.apply_rope = functools.partial(llama3.apply_rope, rope_theta=model.config.rope.theta)  # tunix's base bug
    policy, reference = tunix_model_from_causal_lm(model), tunix_model_from_causal_lm(model)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    refresh = RefreshConfig(num_steps=2, learning_rate=1e-4) if mode == "refresh" else None
    engine = functools.partial(MeasuredRollout, head=DEFAULT_HEAD, num_draft=0 if mode == "plain" else num_draft,
                               slots=prompts_per_step * generations, refresh=refresh,
                               refresh_steps=refresh_steps, refresh_rows=refresh_rows,
                               score_rows=score_rows)  # fmt: skip
    logging = metrics_logger.MetricsLoggerOptions(log_dir=tempfile.mkdtemp(), flush_every_n_steps=1)
    training = rlc.RLTrainingConfig(actor_optimizer=optax.adamw(lr), eval_every_n_steps=10**9, max_steps=steps,
                                    metrics_logging_options=logging)  # fmt: skip
    rollouts = base_rollout.RolloutConfig(max_tokens_to_generate=max_tokens, temperature=1.0, max_prompt_length=64,
                                          kv_cache_size=64 + max_tokens)  # fmt: skip
    meshes = {rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh}
    config = rlc.ClusterConfig(role_to_mesh=meshes, rollout_engine=engine, training_config=training,
                               rollout_config=rollouts)  # fmt: skip
    cluster = rlc.RLCluster(actor=policy, reference=reference, tokenizer=tokenizer, cluster_config=config)
    algorithm = grpo_learner.GRPOConfig(num_generations=generations, num_iterations=1, beta=0.04)
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algorithm, reward_fns=[reward])
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                                          tokenize=False, add_generation_prompt=True)
            for a, b in products(steps * prompts_per_step, seed=0)]  # fmt: skip
    STEP_LISTENERS[:] = [] if on_step is None else [lambda record: on_step({"mode": mode, **record})]
    try:
        learner.train(
            [{"prompts": np.array(chat[i : i + prompts_per_step])} for i in range(0, len(chat), prompts_per_step)]
        )
    finally:
        STEP_LISTENERS.clear()
    if mode != "plain" and compare_repeats and on_step is not None:
        last = [chat[i % prompts_per_step] for i in range(prompts_per_step * generations)]  # as a step's rows
        end = compare_with_plain(cluster.rollout, tokenizer, last, rollouts, num_draft, compare_repeats)
        on_step({"mode": mode, "end_of_run": end})
    return [{"step": step, "mode": mode, "mean_reward": mean_reward, **record}
            for step, (record, mean_reward) in enumerate(zip(RECORDS, MEAN_REWARDS, strict=False))]  # fmt: skip


def compare_with_plain(rollout: MtpRollout, tokenizer, prompts: list[str], config: base_rollout.RolloutConfig,
                       num_draft: int, repeats: int) -> dict:  # fmt: skip
    """The policy `rollout` decodes now, sampled on `prompts` through two engines of as many slots, one drafting
    `num_draft` a round with `rollout`'s head as it is, one plain; a warm-up call each, then `repeats` calls each in
    turn (seeded alike, the order swapped each time): tokens/s of each over its timed calls, and the drafts'."""
    actor, slots = rollout.model(), len(prompts)
    engines = {"drafting": MtpRollout(actor, tokenizer, None, config, head=rollout.decode_model,
                                      num_draft=num_draft, slots=slots),
               "plain": MtpRollout(actor, tokenizer, None, config, num_draft=0, slots=slots)}  # fmt: skip
    totals = {name: [0, 0.0] for name in engines}  # tokens, seconds
    accepted = reached = rounds = emitted = 0
    for call in range(repeats + 1):
        for name in sorted(engines, reverse=call % 2 == 1):
            start = time.perf_counter()
            out = engines[name].generate(prompts, dataclasses.replace(config, seed=call))
            seconds = time.perf_counter() - start
            if call == 0:
                continue  # the warm-up: its programs compile
            totals[name][0] += sum(len(t) for t in out.tokens)
            totals[name][1] += seconds
            if name == "drafting":
                stats = engines[name].last_stats
                accepted, reached = accepted + stats["accepted_at"][0], reached + stats["reached"][0]
                rounds, emitted = rounds + stats["row_rounds"], emitted + stats["emitted"]
    speed = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    return {"drafting_tokens_per_second": speed["drafting"], "plain_tokens_per_second": speed["plain"],
            "speedup": speed["drafting"] / speed["plain"], "first_draft_acceptance": accepted / max(reached, 1),
            "tokens_per_round": emitted / max(rounds, 1), "repeats": repeats, "rows": slots}  # fmt: skip


def main(argv=None) -> int:
    args = arguments(argv)
    start = time.perf_counter()
    with open(args.out, "w") as f:

        def write(record: dict) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()

        rows = run(args.mode, args.steps, args.prompts_per_step, args.generations, args.max_tokens, args.num_draft,
                   args.refresh_steps, args.refresh_rows, args.lr, on_step=write,
                   score_rows=args.score_rows, compare_repeats=args.compare_repeats)  # fmt: skip
    print(f"{len(rows)} RL steps in {time.perf_counter() - start:.0f} s; {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
