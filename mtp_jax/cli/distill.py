"""python -m mtp_jax.distill: self-distilled training data — the trunk's own responses to offline prompts.

Output JSONL, a line per prompt: {"token_ids": prompt + response, "prompt_len", "category", "prompt"}.
Reproducible: the prompts come from `mtp_jax.training.prompt_builder` (seeded); decoding is greedy, or sampled at
--temperature with a random stream per prompt (from --seed and the prompt's index, so a prompt's answer does not
depend on the batch it lands in).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
from tqdm import tqdm

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.engine import Engine, Request
from mtp_jax.decode.prompts import encode_prompts
from mtp_jax.loading import checkpoint
from mtp_jax.loading.hub import MODEL_HELP
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime.errors import UserError, run_cli
from mtp_jax.runtime.files import write_atomically
from mtp_jax.training.prompt_builder import build_prompts


def distill(
    model,
    tokenizer,
    prompts: list[dict],
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[dict]:
    """Plain-decoded (k = 0) responses to chat-templated prompts, as full token sequences: greedy, or sampled at
    `temperature` with prompt i's stream from key(seed) folded with i. `batch_size` rows decode at once, slots that
    refill (`Engine`): a row whose answer ends takes the next prompt."""
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
        request = Request(prompt.token_ids, max_new_tokens, temperature=temperature,
                          key=jax.random.fold_in(root, prompt.index))  # fmt: skip
        prompt_of[engine.submit(request)] = prompt
    responses = {request_id: [] for request_id in prompt_of}
    records: list[dict | None] = [None] * len(encoded)
    with tqdm(total=len(encoded), desc="distilling", unit="prompt", file=sys.stderr) as bar:
        while engine.busy:
            for update in engine.step():
                responses[update.request_id] += update.tokens
                if update.finished:
                    prompt = prompt_of[update.request_id]
                    records[prompt.index] = {
                        "token_ids": list(prompt.token_ids) + responses.pop(update.request_id),
                        "prompt_len": len(prompt.token_ids),
                        "category": prompts[prompt.index].get("category", ""),
                        "prompt": prompts[prompt.index]["prompt"],
                    }
                    bar.update()
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtp_jax.distill", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"{MODEL_HELP} (default: the default model)")
    parser.add_argument("--out", required=True, help="output JSONL")
    parser.add_argument("--num-prompts", type=int, default=1200)
    parser.add_argument("--start", type=int, default=0, help="skip the first N prompts: extends a set made with "
                        "--num-prompts N (a seed's prompt list does not depend on its length)")  # fmt: skip
    parser.add_argument("--split", choices=("train", "eval"), default="train")
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
    model, tokenizer = checkpoint.load(args.model, dtype=args.dtype)
    if tokenizer is None:
        raise UserError("the model has no tokenizer to apply the chat template with")
    prompts = build_prompts(args.num_prompts, args.split, args.seed)[args.start :]
    start = time.perf_counter()
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
