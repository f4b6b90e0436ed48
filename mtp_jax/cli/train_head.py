"""python -m mtp_jax.train_head: train or finetune an MTP head on a frozen trunk (optax, orbax checkpoints).

--data is JSONL of token sequences ({"token_ids": [...], "prompt_len": n}, as `python -m mtp_jax.distill` writes)
or of prompts ({"prompt": ...}: the trunk answers them first, greedily, to make self-distilled sequences).
Writes a head folder (DeepSeek-style keys, bf16) that `load_model(..., head=FOLDER)` attaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from mtp_jax.cli.distill import distill
from mtp_jax.config.model import MtpConfig
from mtp_jax.loading import checkpoint
from mtp_jax.loading.heads import HEAD_CONFIG, save_head, trunk_fingerprint
from mtp_jax.loading.hub import MODEL_HELP
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.runtime.errors import UserError, run_cli
from mtp_jax.runtime.files import write_atomically
from mtp_jax.training import answer_shards
from mtp_jax.training.acceptance import acceptance_counts, summarize, teacher_forced_predictions
from mtp_jax.training.head_training import TrainConfig, Trainer, frequent_tokens, grow_head, init_head_from_trunk
from mtp_jax.training.sequences import HEAD_PATHS, SequenceData, check_sequences, read_records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.train_head", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"the trunk: {MODEL_HELP} (default: the default model)")
    parser.add_argument("--data", required=True, help="training JSONL (token sequences or prompts), or a folder of "
                        "answer shards (python -m mtp_jax.distill --shards)")  # fmt: skip
    parser.add_argument("--eval-data", help="held-out JSONL for teacher-forced acceptance")
    parser.add_argument("--hiddens-cache", help="folder to keep the trunk's hiddens over the data in, read back by "
                        "later runs over the same data and trunk (about 2.2 MB a sequence of 320 tokens of the default "
                        "model)")  # fmt: skip
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True, help="head folder to write")
    parser.add_argument("--checkpoint-dir", help="orbax checkpoints (default: OUT/checkpoints)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint (of a run with "
                        "the same settings and data)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="start afresh over the head and checkpoints of an "
                        "earlier run in --out (--checkpoint-dir)")  # fmt: skip
    parser.add_argument("--init", choices=("trunk-last", "existing", "random"), default="trunk-last",
                        help="start from the trunk's last layer, the model's head (or --head), or random")  # fmt: skip
    parser.add_argument("--head", help="with --init existing: the head folder to finetune (default: the model's "
                        "own, or the shipped head of the default model)")  # fmt: skip
    parser.add_argument("--block-layers", type=int, help="decoder layers in the MTP block (default: the finetuned "
                        "head's, else 1); with --init existing, layers beyond the head's are added as identities "
                        "(the trunk's last layers with their residual outputs at zero)")  # fmt: skip
    parser.add_argument("--fused-layers", type=layer_list, help="trunk layers (0-based, comma-separated) whose "
                        "outputs join the final hidden in what the head reads (EAGLE-3's fused features, e.g. 2,14); "
                        "--init existing adds them to a head without any, starting as it drafts")  # fmt: skip
    parser.add_argument("--num-mtp-steps", type=int, default=3, help="K recursive steps in the objective")
    parser.add_argument(
        "--objective", choices=("ce", "kl", "tv"), default="ce",
        help="ce: cross-entropy on the data's next-next tokens; kl / tv: match the trunk's next-token distribution "
        "(KL divergence / total variation, the latter the rejection rate of sampled verification at temperature 1)",
    )  # fmt: skip
    parser.add_argument("--training-time-test", action="store_true", help="the deeper steps attend as a decode "
                        "round's drafts do: to the MTP layer's states over the true hiddens up to their chain's start "
                        "and to their chain's own drafts (EAGLE-3's training-time test)")  # fmt: skip
    parser.add_argument("--draft-vocab", type=int, default=0, help="draft over the N most frequent tokens "
                        "(0: all); --init existing keeps the head's own subset when it has N tokens")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=320)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    return parser


def layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected layer numbers like 2,14") from None


def training_model(trunk, args, records):
    """The model to train: the trunk plus a head (the existing one, or new with a DeepSeek-style layout)."""

    if args.init == "existing":
        if not trunk.config.has_mtp:
            raise UserError("--init existing: this model has no MTP head to finetune")
        base = trunk.config.mtp
    else:
        base = MtpConfig(layout="deepseek")
    block_layers = args.block_layers or (base.block_layers if args.init == "existing" else 1)
    if args.init == "existing" and block_layers < base.block_layers:
        raise UserError(f"--block-layers {block_layers}: the head to finetune has {base.block_layers}; "
                        "a block can grow, not shrink")  # fmt: skip
    available = trunk.config.segments()[-1].count  # a new block starts from the trunk's last layers of its kind
    if block_layers > available:
        raise UserError(f"--block-layers {block_layers}: the trunk's last run of layers of the MTP layer's kind has "
                        f"{available}")  # fmt: skip
    fused = base.fused_layers if args.fused_layers is None else args.fused_layers
    if args.init == "existing" and base.fused_layers and fused != base.fused_layers:
        raise UserError(f"--fused-layers {','.join(map(str, fused))}: the head to finetune fuses layers "
                        f"{','.join(map(str, base.fused_layers))}; fused layers can be added, not changed")  # fmt: skip
    vocab = trunk.config.vocab_size
    draft_size = min(args.draft_vocab, vocab) if args.draft_vocab else 0
    try:
        cfg = trunk.config.replace(mtp=MtpConfig(layout=base.layout, recurse_normed=base.recurse_normed,
                                                 draft_vocab_size=draft_size, block_layers=block_layers,
                                                 fused_layers=fused))  # fmt: skip
    except ValueError as e:
        raise UserError(f"--fused-layers: {e}") from None
    model = CausalLM(cfg, dtype=trunk.dtype, rngs=nnx.Rngs(args.seed))
    keep = nnx.state(trunk, nnx.PathContains("mtp")) if args.init == "existing" else None
    # the head's state, sized by its config, and a held draft table (`CausalLM.hold_draft_table`: the old
    # vocabulary's rows) stay out
    nnx.update(model, nnx.state(trunk, nnx.Not(HEAD_PATHS)))
    if keep is not None and block_layers == base.block_layers and fused == base.fused_layers:
        nnx.update(model, keep)
    elif keep is not None:
        init_head_from_trunk(model, jax.random.key(args.seed))
        grow_head(model, keep)
    elif args.init == "trunk-last":
        init_head_from_trunk(model, jax.random.key(args.seed))
    if draft_size:
        kept = trunk.draft_vocab[...] if args.init == "existing" and trunk.draft_vocab is not None else None
        if kept is not None and kept.shape[0] == draft_size:  # finetuning keeps the head's vocabulary of that size
            model.draft_vocab[...] = kept
        else:
            model.draft_vocab[...] = frequent_tokens(records, vocab, draft_size)
    return model


def load_sequences(path: str, model, tokenizer) -> list[dict]:
    """The token sequences of `path`: a folder of answer shards (`distill --shards`), JSONL of sequences, or JSONL
    of prompts (answered here by the trunk, greedily)."""
    if os.path.isdir(path):
        return answer_shards.read(path, trunk_fingerprint(model.config))
    try:
        records = read_records(path)
    except OSError as e:
        raise UserError(f"{path}: cannot read JSONL ({e.strerror or e})") from None
    if not records:
        raise UserError(f"{path}: no records")
    if all(isinstance(r, dict) and "token_ids" in r for r in records):
        check_sequences(records, model.config.vocab_size, path)
        return records
    if not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in records):
        raise UserError(f'{path}: every line needs "token_ids" or "prompt"')
    if tokenizer is None:
        raise UserError("prompts given but the model has no tokenizer: give token_ids")
    print(f"self-distilling {len(records)} prompts with the trunk (greedy)", file=sys.stderr)
    return distill(model, tokenizer, records, max_new_tokens=256, batch_size=16)


def evaluate(model, data, num_steps: int) -> dict:
    """Teacher-forced acceptance per depth over the responses of held-out sequences (`python -m mtp_jax.score`'s
    metric, counted where decoding drafts)."""

    totals = None
    for start in range(0, len(data), 8):
        rows = slice(start, start + 8)
        predictions, trunk = teacher_forced_predictions(model, data.tokens[rows], num_steps)
        counts = acceptance_counts(predictions, trunk, data.lengths[rows], starts=data.loss_start[rows])
        totals = counts if totals is None else {k: [a + b for a, b in zip(totals[k], counts[k], strict=True)]
                                                for k in totals}  # fmt: skip
    return summarize(totals)


def check_arguments(args) -> None:
    """Refuse option values that cannot run, in one line each, before anything is loaded."""
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 4 or args.num_mtp_steps < 1:
        raise UserError("--steps, --batch-size, --num-mtp-steps must be >= 1 and --seq-len >= 4")
    if args.block_layers is not None and args.block_layers < 1:
        raise UserError("--block-layers must be >= 1")
    if args.head and args.init != "existing":
        raise UserError("--head goes with --init existing")
    if args.resume and args.overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    if args.hiddens_cache:
        try:
            os.makedirs(args.hiddens_cache, exist_ok=True)
        except OSError as e:
            raise UserError(f"--hiddens-cache {args.hiddens_cache}: cannot create the folder ({e.strerror})") from None


def run(args) -> int:
    check_arguments(args)
    checkpoints = args.checkpoint_dir or os.path.join(args.out, "checkpoints")
    steps, head_file = saved_steps(checkpoints), os.path.join(args.out, HEAD_CONFIG)
    resuming = args.resume and bool(steps)
    earlier = steps[:1] or ([head_file] if os.path.isfile(head_file) else [])
    if earlier and not resuming and not args.overwrite:
        what, hint = ("checkpoint", "--resume continues that run, ") if steps else ("head", "")
        raise UserError(f"{earlier[0]}: another run's {what} is there: {hint}--overwrite starts afresh over it")
    trunk, tokenizer = checkpoint.load(args.model, dtype=args.dtype, head=args.head, float_head=True)
    records = load_sequences(args.data, trunk, tokenizer)
    model = training_model(trunk, args, records)
    del trunk
    settings = run_settings(args, model)
    settings_file = os.path.join(checkpoints, RUN_SETTINGS)
    if resuming:
        check_same_run(settings_file, settings)
    else:
        for step in steps:
            shutil.rmtree(step)
        write_atomically(settings_file, json.dumps(settings, indent=2) + "\n")
    with tqdm(total=len(records), desc="trunk hiddens", unit="seq", file=sys.stderr) as bar:
        data = SequenceData(model, records, args.seq_len, progress=bar.update, cache_dir=args.hiddens_cache)
    eval_data = None
    if args.eval_data:
        eval_records = load_sequences(args.eval_data, model, tokenizer)
        eval_data = SequenceData(model, eval_records, args.seq_len, cache_dir=args.hiddens_cache)
    cfg = TrainConfig(
        num_steps=args.num_mtp_steps, objective=args.objective, train_steps=args.steps, batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=args.warmup, seed=args.seed, training_time_test=args.training_time_test,
    )  # fmt: skip
    trainer = Trainer(model, cfg)
    if resuming and trainer.restore(checkpoints):
        print(f"resumed from step {trainer.step}", file=sys.stderr)
    log = []
    start = time.perf_counter()
    with tqdm(total=args.steps, initial=trainer.step, desc="training", unit="step", file=sys.stderr) as bar:
        while trainer.step < args.steps:
            metrics = trainer.train_step(data.batch(trainer.step, args.batch_size, args.seed))
            bar.update(1)
            if trainer.step % args.eval_every == 0 or trainer.step == args.steps:
                entry = {"step": trainer.step, "loss": float(metrics["loss"]),
                         "accuracy_per_step": np.asarray(metrics["acc"]).round(4).tolist()}  # fmt: skip
                diverged = trainer.nonfinite()
                if diverged:
                    raise UserError(f"training diverged by step {trainer.step} (loss {entry['loss']}): "
                                    f"{diverged[0]} is not finite; nothing saved from this step on "
                                    "(a lower --lr may help)")  # fmt: skip
                if eval_data is not None:
                    entry["eval"] = evaluate(trainer.model(), eval_data, args.num_mtp_steps)
                log.append(entry)
                bar.write(json.dumps(entry), file=sys.stderr)
                trainer.save(checkpoints)
    save_head(trainer.model(), args.out)
    report = {
        "train_seconds": time.perf_counter() - start,
        "sequences": len(data),
        "response_tokens": int(np.sum(data.lengths - data.loss_start)),
        "args": vars(args),
        "log": log,
    }
    write_atomically(os.path.join(args.out, "training_report.json"), json.dumps(report, indent=2))
    print(f"wrote head to {args.out} after {trainer.step} steps", file=sys.stderr)
    return 0


RUN_SETTINGS = "run.json"  # beside the checkpoints: what --resume must match


def saved_steps(checkpoints: str) -> list[str]:
    """The checkpoints orbax committed in `checkpoints`: folders named by their step."""
    if not os.path.isdir(checkpoints):
        return []
    return sorted(os.path.join(checkpoints, n) for n in os.listdir(checkpoints) if n.isdigit())


def run_settings(args, model) -> dict:
    """What makes a run's checkpoints continue it: the trunk, the head's shape and draft vocabulary, the data and the
    optimization settings (not --steps: a run may be extended)."""

    digest = hashlib.sha256()
    folder = os.path.isdir(args.data)
    files = sorted(os.path.join(args.data, n) for n in os.listdir(args.data)) if folder else [args.data]
    for file in files:
        digest.update(os.path.basename(file).encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
    vocab = None if model.draft_vocab is None else np.asarray(model.draft_vocab[...])
    settings = {
        "trunk": trunk_fingerprint(model.config),
        "head": dataclasses.asdict(model.config.mtp),
        "draft_vocab_sha256": None if vocab is None else hashlib.sha256(vocab.tobytes()).hexdigest(),
        "data_sha256": digest.hexdigest(),
        "dtype": np.dtype(model.dtype).name,
        **{name: getattr(args, name) for name in ("objective", "num_mtp_steps", "batch_size", "seq_len", "lr",
                                                  "warmup", "seed", "training_time_test")},
    }  # fmt: skip
    return json.loads(json.dumps(settings))  # as read back from the file


def check_same_run(path: str, settings: dict) -> None:
    """Refuse to resume checkpoints that another run (other settings or data) wrote."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"--resume: {path} is missing or unreadable: cannot tell these checkpoints are this run's; "
                        "--overwrite starts afresh") from None  # fmt: skip
    differ = [name for name in settings if saved.get(name) != settings[name]]
    if differ:
        shown = ", ".join(
            name if name.endswith("sha256") else f"{name} {saved.get(name)!r} (now {settings[name]!r})"
            for name in differ
        )
        raise UserError(f"--resume: the checkpoints beside {path} are another run's; it differs in {shown}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(run, args)
