"""Self-distilled answers kept as token-id shards that accumulate across runs and machines.

A shard holds the answers of one run of prompts of the prompt builder: a split, the categories mixed (named only
when not the default mix), a seed (which orders the prompts and, when sampling, seeds each prompt's stream), a
temperature and a token budget, and prompt indices [start, end) of that list. Its name says all of these, so a
generation that is killed, or run again on another machine with the same settings, makes only the shards that are
missing, and shards of other mixes, seeds or temperatures add to the same folder. One `.npz` a shard, written
whole or not at all:

    tokens       [T] uint16 (uint32 for a vocabulary past 65536): every record's prompt and answer, one after another
    offsets      [R + 1] int64: record r is tokens[offsets[r]:offsets[r + 1]]
    prompt_lens  [R] int32
    prompt_index [R] int32: the prompt's index in its seed's list
    categories   [R] int8: an index into CATEGORIES
    meta         a JSON string: the settings above and the trunk that answered (its fingerprint)
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from mtp_jax.runtime.errors import UserError
from mtp_jax.runtime.files import write_file_atomically
from mtp_jax.training.prompt_builder import CATEGORIES, MIXED_CATEGORIES

SHARD_PROMPTS = 256  # prompts a shard, by default
NAME = re.compile(r"(train|eval)(-[a-z+]+)?-seed(\d+)-t([0-9.]+)-max(\d+)-(\d{7})-(\d{7})\.npz")


@dataclasses.dataclass(frozen=True)
class ShardRun:
    """The settings a shard's answers were made with."""

    split: str
    seed: int
    temperature: float
    max_new_tokens: int
    categories: tuple[str, ...] = MIXED_CATEGORIES

    def name(self, start: int, end: int) -> str:
        mix = "" if self.categories == MIXED_CATEGORIES else "-" + "+".join(self.categories)
        return (f"{self.split}{mix}-seed{self.seed}-t{self.temperature:g}-max{self.max_new_tokens}"
                f"-{start:07d}-{end:07d}.npz")  # fmt: skip


def ranges(num_prompts: int, shard_prompts: int, available: int) -> list[tuple[int, int]]:
    """The prompt ranges of the shards that hold the first `num_prompts` prompts: whole shards of `shard_prompts`
    (so that a longer run's shards are the shorter one's and more), the last cut at the `available` prompts."""
    end = min(-(-num_prompts // shard_prompts) * shard_prompts, available)
    return [(s, min(s + shard_prompts, end)) for s in range(0, end, shard_prompts)]


def missing(folder: str, run: ShardRun, ranges_: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Those of `ranges_` whose shards of `run` are not yet in `folder`."""
    return [r for r in ranges_ if not (Path(folder) / run.name(*r)).exists()]


def write(folder: str, run: ShardRun, start: int, end: int, records: list[dict], trunk: dict) -> Path:
    """Write the records of prompts [start, end) (each {"token_ids", "prompt_len", "category"}) as one shard."""
    lengths = np.asarray([len(r["token_ids"]) for r in records], np.int64)
    vocab = trunk.get("vocab_size", 1 << 32)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    meta = {**dataclasses.asdict(run), "start": start, "end": end, "trunk": trunk}
    arrays = {
        "tokens": np.concatenate([np.asarray(r["token_ids"], dtype) for r in records]),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]),
        "prompt_lens": np.asarray([r["prompt_len"] for r in records], np.int32),
        "prompt_index": np.arange(start, end, dtype=np.int32),
        "categories": np.asarray([CATEGORIES.index(r["category"]) for r in records], np.int8),
        "meta": np.asarray(json.dumps(meta)),
    }
    path = Path(folder) / run.name(start, end)
    write_file_atomically(str(path), lambda f: np.savez(f, **arrays))
    return path


def read(folder: str, trunk: dict | None = None, split: str = "train") -> list[dict]:
    """Every record of the `split` shards in `folder` as {"token_ids", "prompt_len", "category"}, shards in name
    order. A file that is not a shard (another name, a damaged file) or, with `trunk`, a shard another trunk
    answered, is refused in one line."""
    paths = sorted(p for p in Path(folder).iterdir() if NAME.fullmatch(p.name)) if Path(folder).is_dir() else []
    if not paths:
        raise UserError(f"{folder}: no answer shards (files named like {ShardRun('train', 0, 0.0, 256).name(0, 256)})")
    records = []
    for path in paths:
        if not path.name.startswith(split + "-"):
            continue
        try:
            with np.load(path) as shard:
                meta = json.loads(str(shard["meta"]))
                tokens, offsets = shard["tokens"].astype(np.int64), shard["offsets"]
                prompt_lens, categories = shard["prompt_lens"], shard["categories"]
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{path}: not a readable answer shard ({e})") from None
        if trunk is not None and meta.get("trunk") != trunk:
            raise UserError(f"{path}: answered by another trunk ({meta.get('trunk')}, not {trunk})")
        for r in range(len(prompt_lens)):
            records.append({
                "token_ids": tokens[offsets[r] : offsets[r + 1]].tolist(),
                "prompt_len": int(prompt_lens[r]),
                "category": CATEGORIES[int(categories[r])],
            })  # fmt: skip
    return records
