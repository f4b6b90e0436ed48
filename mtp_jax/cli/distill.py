"""python -m mtp_jax.distill: self-distilled training data — the trunk's own responses to offline prompts.

Output JSONL (--out), a line per prompt: {"token_ids": prompt + response, "prompt_len", "category", "prompt"}; or
token-id shards (--shards FOLDER, `mtp_jax.training.answer_shards`) that accumulate: a run makes only the shards of
its settings that the folder lacks, so a killed run resumes where it stopped and runs of other seeds, temperatures or
machines add to the same folder. Reproducible: the prompts come from `mtp_jax.training.prompt_builder` (seeded);
decoding is greedy, or sampled at --temperature with a random stream per prompt (from --seed and the prompt's index,
so a prompt's answer does not depend on the batch it lands in).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence

import jax
from tqdm import tqdm

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.engine import Engine, Request
from mtp_jax.decode.prompts import encode_prompts
from mtp_jax.loading import checkpoint
from mtp_jax.loading.heads import trunk_fingerprint
from mtp_jax.loading.hub import MODEL_HELP
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.errors import UserError, run_cli
from mtp_jax.runtime.files import write_atomically
from mtp_jax.training import answer_shards
from mtp_jax.training.prompt_builder import CATEGORIES, MIXED_CATEGORIES, build_prompts


def answers(model, tokenizer, prompts: list[dict], *, max_new_tokens: int, batch_size: int, temperature: float = 0.0,
            seed: int = 0, streams: Sequence[int] | None = None) -> Iterator[tuple[int, dict]]:  # fmt: skip
    """(i, record) for each prompt i of `prompts` as its answer finishes: plain-decoded (k = 0) responses to
    chat-templated prompts, as full token sequences; greedy, or sampled at `temperature` with the stream of key(seed)
    folded with streams[i] (default i). `batch_size` rows decode at once, slots that refill (`Engine`): a row whose
    answer ends takes the next prompt."""
    encoded = encode_prompts(
        [p["prompt"] for p in prompts], tokenizer, chat=True, vocab_size=model.config.vocab_size,
        context=model.config.max_position_embeddings,
    )  # fmt: skip
    cfg = DecodeConfig(num_draft=0, max_new_tokens=max_new_tokens)
    engine = Engine(model, cfg, slots=min(batch_size, len(encoded)),
                    max_len=max(len(p.token_ids) for p in encoded) + max_new_tokens)  # fmt: skip
    root = jax.random.key(seed)
    prompt_of = {}
    for prompt in encoded:
        stream = prompt.index if streams is None else streams[prompt.index]
        request = Request(prompt.token_ids, max_new_tokens, temperature=temperature,
                          key=jax.random.fold_in(root, stream))  # fmt: skip
        prompt_of[engine.submit(request)] = prompt
    responses = {request_id: [] for request_id in prompt_of}
    with tqdm(total=len(encoded), desc="distilling", unit="prompt", file=sys.stderr) as bar:
        while engine.busy:
            for update in engine.step():
                responses[update.request_id] += update.tokens
                if update.finished:
                    prompt = prompt_of[update.request_id]
                    yield (
                        prompt.index,
                        {
                            "token_ids": list(prompt.token_ids) + responses.pop(update.request_id),
                            "prompt_len": len(prompt.token_ids),
                            "category": prompts[prompt.index].get("category", ""),
                            "prompt": prompts[prompt.index]["prompt"],
                        },
                    )
                    bar.update()


def distill(model, tokenizer, prompts: list[dict], *, max_new_tokens: int, batch_size: int, temperature: float = 0.0,
            seed: int = 0) -> list[dict]:  # fmt: skip
    """Every answer of `answers`, in the prompts' order."""
    records: list[dict | None] = [None] * len(prompts)
    for index, record in answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                 temperature=temperature, seed=seed):  # fmt: skip
        records[index] = record
    return records


def distill_shards(model, tokenizer, folder: str, run: answer_shards.ShardRun, num_prompts: int, shard_prompts: int,
                   batch_size: int) -> tuple[int, int]:  # fmt: skip
    """Make the shards of `run` holding its first `num_prompts` prompts (whole shards of `shard_prompts`) that
    `folder` lacks, each written as soon as its prompts are all answered; (shards written, response tokens in them)."""
    prompts = build_prompts(-(-num_prompts // shard_prompts) * shard_prompts, run.split, run.seed, run.categories)
    todo = answer_shards.missing(folder, run, answer_shards.ranges(num_prompts, shard_prompts, len(prompts)))
    if not todo:
        return 0, 0
    wanted = [i for start, end in todo for i in range(start, end)]
    waiting = {r: {} for r in todo}
    shard_of = {i: r for r in todo for i in range(*r)}
    written = tokens = 0
    for position, record in answers(model, tokenizer, [prompts[i] for i in wanted], max_new_tokens=run.max_new_tokens,
                                    batch_size=batch_size, temperature=run.temperature, seed=run.seed,
                                    streams=wanted):  # fmt: skip
        index = wanted[position]
        shard = shard_of[index]
        waiting[shard][index] = record
        if len(waiting[shard]) == shard[1] - shard[0]:
            done = waiting.pop(shard)
            records = [done[i] for i in range(*shard)]
            answer_shards.write(folder, run, *shard, records, trunk_fingerprint(model.config))
            written += 1
            tokens += sum(len(r["token_ids"]) - r["prompt_len"] for r in records)
    return written, tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.distill", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"{MODEL_HELP} (default: the default model)")
    output = parser.add_mutually_exclusive_group(required=True)
    output.add_argument("--out", help="output JSONL")
    output.add_argument("--shards", metavar="FOLDER", help="write token-id shards into FOLDER instead, only those "
                        "of these settings it lacks (a resumable, accumulating data set)")  # fmt: skip
    parser.add_argument("--shard-prompts", type=int, default=answer_shards.SHARD_PROMPTS,
                        help=f"with --shards: prompts a shard (default {answer_shards.SHARD_PROMPTS})")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=1200)
    parser.add_argument("--start", type=int, default=0, help="skip the first N prompts: extends a set made with "
                        "--num-prompts N (a seed's prompt list does not depend on its length)")  # fmt: skip
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    parser.add_argument("--categories", default=",".join(MIXED_CATEGORIES), help=f"prompt categories to mix, "
                        f"comma-separated, of {', '.join(CATEGORIES)} (default: %(default)s)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt list and, with --temperature, sampling")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; > 0: sampled ones "
                        "(sampled answers teach a head the text it drafts for under sampling)")  # fmt: skip
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    compile_cache.add_argument(parser)
    return parser


def run(args) -> int:

    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.batch_size < 1:
        raise UserError("--num-prompts, --max-new-tokens and --batch-size must be >= 1")
    if not args.temperature >= 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 <= args.start < args.num_prompts:
        raise UserError(f"--start must be in 0..{args.num_prompts - 1} (--num-prompts - 1)")
    if args.shards is not None and (args.start or args.shard_prompts < 1):
        raise UserError("--shards makes the missing shards of --num-prompts prompts: no --start; --shard-prompts >= 1")
    categories = tuple(args.categories.split(","))
    if not categories or not set(categories) <= set(CATEGORIES) or len(set(categories)) != len(categories):
        raise UserError(f"--categories {args.categories!r}: name each of {', '.join(CATEGORIES)} at most once")
    model, tokenizer = checkpoint.load(args.model, dtype=args.dtype)
    if tokenizer is None:
        raise UserError("the model has no tokenizer to apply the chat template with")
    start = time.perf_counter()
    if args.shards is not None:
        shard_run = answer_shards.ShardRun(args.split, args.seed, args.temperature, args.max_new_tokens, categories)
        written, tokens = distill_shards(model, tokenizer, args.shards, shard_run, args.num_prompts,
                                         args.shard_prompts, args.batch_size)  # fmt: skip
        print(f"{written} shards written ({tokens} response tokens) into {args.shards} in "
              f"{time.perf_counter() - start:.0f}s", file=sys.stderr)  # fmt: skip
        return 0
    prompts = build_prompts(args.num_prompts, args.split, args.seed, categories)[args.start :]
    records = distill(
        model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        temperature=args.temperature, seed=args.seed,
    )  # fmt: skip
    write_atomically(args.out, "".join(json.dumps(r) + "\n" for r in records))
    tokens = sum(len(r["token_ids"]) - r["prompt_len"] for r in records)
    print(f"{len(records)} sequences, {tokens} response tokens in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with compile_cache.active(args.no_compile_cache):
        return run_cli(run, args)
