"""`python -m mtp_jax.decode`'s output: JSONL rows written as each batch finishes (and resumed from a partial file), or
text on a terminal."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys

import numpy as np
from jax.experimental import multihost_utils

from mtp_jax.runtime.errors import UserError

ROW_SETTINGS = ("model", "head", "dtype", "weights", "activations", "no_mtp", "num_draft", "tree", "tree_width",
                "adaptive", "round_costs", "invariant", "temperature", "top_p", "top_k", "max_new_tokens", "seed",
                "no_chat")  # fmt: skip
CHAIN_SETTINGS = tuple(k for k in ROW_SETTINGS if not k.startswith("tree"))  # a chain's run: its partial file keeps
# the name runs from before draft trees gave it


class RowOutput:
    """Where process 0 writes finished rows, batch by batch: stdout (JSONL, or `terminal_text` when it is a
    terminal), or `--out`'s partial file, renamed to `--out` by `finish`.

    The partial file, FILE.partial-<hash of the settings that shape rows>, holds whole rows in the output's format,
    in input order. A fresh run refuses to start beside one (its rows would be lost); --resume keeps its rows (or a
    complete FILE's) when they are those of this run's first prompts, and refuses one of other settings."""

    def __init__(self, args, prompts: list[str | list[int]]):
        self.file, self.kept, self.written = None, 0, 0
        self.terminal = args.out is None and sys.stdout.isatty()
        self.total = len(prompts)
        if args.out is None:
            return
        self.out = os.path.abspath(args.out)
        folder, name = os.path.split(self.out)
        os.makedirs(folder, exist_ok=True)
        settings = {k: getattr(args, k) for k in ROW_SETTINGS if k in CHAIN_SETTINGS or args.tree}
        settings.update({k: os.path.abspath(settings[k]) for k in ("model", "head") if settings[k] is not None})
        key = json.dumps(settings, sort_keys=True)
        self.partial = f"{self.out}.partial-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        partials = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith(f"{name}.partial-"))
        if partials and not args.resume:
            raise UserError(f"{partials[0]} holds the finished rows of an unfinished run: --resume continues it "
                            "(same settings); remove it to start over")  # fmt: skip
        if partials and self.partial not in partials:
            raise UserError(f"--resume: {partials[0]} was written with other settings (model, head, dtype, weights, "
                            "drafts, sampling, budget, seed or chat): rerun with those, or remove it")  # fmt: skip
        source = self.partial if partials else self.out if args.resume and os.path.isfile(self.out) else None
        rows, size = read_rows(source, prompts) if source else ([], 0)
        self.file = os.fdopen(os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o666), "r+b")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise UserError(f"{self.partial}: another decode is writing it") from None
        if source == self.out:
            with open(self.out, "rb") as f:
                self.file.write(f.read(size))
        self.file.truncate(size)  # a row cut short by a kill goes
        self.file.seek(size)
        self.kept = len(rows)
        if rows:
            print(f"resuming: {len(rows)} finished rows kept from {source}", file=sys.stderr)

    def write(self, rows: list[dict]) -> None:
        if self.terminal:
            lines = "".join(terminal_text(r, self.total) for r in rows)
        else:
            lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        if self.file is None:
            sys.stdout.write(lines)
            sys.stdout.flush()
        else:
            self.file.write(lines.encode("utf-8"))
            self.file.flush()
            os.fsync(self.file.fileno())
        self.written += len(rows)

    def show(self, text: str) -> None:
        """Part of a lone prompt's answer, on the terminal as it is generated (`text_stream.stream_prompt`)."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def shown(self, row: dict) -> None:
        """The lone prompt's answer has been shown piece by piece: end it as `terminal_text` ends a row."""
        sys.stdout.write("\n" if row["text"] else terminal_text(row, self.total))
        sys.stdout.flush()
        self.written += 1

    def finish(self) -> None:
        """Every row is written: the partial file becomes `--out`."""
        if self.file is not None:
            os.replace(self.partial, self.out)
            self.file.close()

    def abandon(self) -> str:
        """The run stops early: keep the partial file when it holds rows (said in the returned note), else remove it."""
        if self.file is None:
            return ""
        rows = self.kept + self.written
        self.file.close()
        if not rows:
            os.unlink(self.partial)
            return ""
        return f"{rows} finished rows kept in {self.partial}; rerun with --resume to continue"


def terminal_text(row: dict, total: int) -> str:
    """A row as a person reads it: the generated text (its token ids where it has none: no tokenizer), under a
    header line with the prompt's number and its start when there are several prompts."""
    answer = row["text"] or ("token ids: " + json.dumps(row["token_ids"]) if row["token_ids"] else "")
    if total == 1:
        return answer + "\n"
    prompt = row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])
    prompt = " ".join(prompt.split())
    prompt = prompt if len(prompt) <= 60 else prompt[:59] + "…"
    separator = "\n" if row["index"] > 0 else ""
    return f"{separator}=== [{row['index'] + 1}/{total}] {prompt} ===\n{answer}\n"


def read_rows(path: str, prompts: list[str | list[int]]) -> tuple[list[dict], int]:
    """The whole rows at the start of an output file, checked to be rows of `prompts` (texts or token ids) in order,
    and the bytes they take."""
    rows, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # cut short by a kill
            try:
                row = json.loads(line)
            except ValueError:
                raise UserError(f"--resume: {path} line {len(rows) + 1} is not an output row") from None
            i = len(rows)
            if not isinstance(row, dict) or set(row) != set(ROW_FIELDS) or row["index"] != i:
                raise UserError(f"--resume: {path} line {i + 1} is not row {i} of a decode output")
            if i >= len(prompts) or row["prompt"] != prompts[i]:
                raise UserError(f"--resume: {path} row {i} is not for prompt {i} of this run: remove the file to "
                                "start over")  # fmt: skip
            rows.append(row)
            size += len(line)
    return rows, size


ROW_FIELDS = ("index", "prompt", "text", "token_ids", "num_tokens", "finish_reason")


def open_output(args, prompts: list[str | list[int]], lead: bool) -> tuple[RowOutput | None, int]:
    """(process 0's RowOutput, else None; the rows already done, the same on every process)."""
    output = error = None
    if lead:
        try:
            output = RowOutput(args, prompts)
        except Exception as e:  # the other processes must not wait for a count that never comes
            error = e
    kept = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if error else output.kept if lead else 0)))
    if error is not None:
        raise error
    if kept < 0:
        raise UserError("process 0 could not open the output (its error says why)")
    return output, kept
