"""`python -m mtp_jax.decode` on a tiny checkpoint: output format, stats, MTP == plain, and bad input."""

from __future__ import annotations

import hashlib
import io
import json
import sys

import jax
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cli import decode as decode_cli
from mtp_jax.cli.decode import main as decode_main
from mtp_jax.cli.decode_output import ROW_SETTINGS, RowOutput, terminal_text
from mtp_jax.config import execution_plan
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.runtime.cache_folder import CACHE_ENV
from tests.support.tiny_models import tiny_config

STATS_FIELDS = {
    "execution_plan",
    "num_draft",
    "tree",
    "mean_accepted_depth",
    "rounds",
    "generated_tokens",
    "mean_accepted_length",
    "acceptance_rate",
    "rounds_by_num_draft",
    "tree_rounds",
    "rest_rounds",
    "acceptance_per_position",
    "tokens_per_second",
    "wall_seconds",
    "load_seconds",
    "compile_seconds",
    "compile_from_cache",
    "device",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny HF folder with a DeepSeek-style MTP head, and one without a head."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_config("deepseek", vocab=40, eos=(2,)).replace(family="qwen2", qkv_bias=True, max_position_embeddings=64)
    save_hf_folder(mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(3)), root / "with_head")
    save_hf_folder(mtp_jax.CausalLM(cfg.replace(mtp=None), rngs=nnx.Rngs(3)), root / "no_head")
    prompts = root / "prompts.jsonl"
    rows = [[5, 6, 7, 8, 9], [11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [30, 31]]
    prompts.write_text("".join(json.dumps({"token_ids": r}) + "\n" for r in rows))
    return root


def decode(capsys, *args) -> tuple[int, str, str]:
    code = decode_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_jsonl_output_stats_and_mtp_equals_plain(checkpoints, capsys, tmp_path):
    common = ["--model", checkpoints / "with_head", "--prompts-file", checkpoints / "prompts.jsonl"]
    common += ["--max-new-tokens", 12, "--batch-size", 2, "--dtype", "float32"]
    code, _, err = decode(capsys, *common, "--num-draft", 3, "--out", tmp_path / "mtp.jsonl",
                          "--stats-json", tmp_path / "s.json")  # fmt: skip
    assert code == 0, err
    assert "mean accepted length" in err
    code, _, err = decode(capsys, *common, "--no-mtp", "--out", tmp_path / "plain.jsonl")
    assert code == 0, err
    mtp_rows = [json.loads(line) for line in (tmp_path / "mtp.jsonl").read_text().splitlines()]
    plain_rows = [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    assert [r["index"] for r in mtp_rows] == [0, 1, 2, 3, 4]
    for mtp_row, plain_row in zip(mtp_rows, plain_rows, strict=True):
        assert set(mtp_row) == {"index", "prompt", "text", "token_ids", "num_tokens", "finish_reason"}
        assert mtp_row["token_ids"] == plain_row["token_ids"]
        assert mtp_row["num_tokens"] == len(mtp_row["token_ids"])
        if mtp_row["finish_reason"] == "eos":
            assert mtp_row["token_ids"][-1] == 2
        else:
            assert mtp_row["num_tokens"] == 12 and 2 not in mtp_row["token_ids"]
    assert mtp_rows[1]["prompt"] == [11]
    stats = json.loads((tmp_path / "s.json").read_text())
    assert set(stats) == STATS_FIELDS
    assert stats["execution_plan"] == traced_plan.resolve().as_dict()  # float32, no mesh: the plan for this CPU
    assert stats["num_draft"] == 3 and len(stats["acceptance_per_position"]) == 3
    assert stats["generated_tokens"] == sum(r["num_tokens"] for r in mtp_rows)
    assert 1.0 <= stats["mean_accepted_length"] <= 4.0


@pytest.mark.slow
def test_a_draft_tree_decodes_plain_greedy(checkpoints, capsys, tmp_path):
    """--tree N: rows equal to --no-mtp's, the tree and its depth in the statistics and the summary line."""
    common = ["--model", checkpoints / "with_head", "--prompts-file", checkpoints / "prompts.jsonl"]
    common += ["--max-new-tokens", 12, "--batch-size", 2, "--dtype", "float32"]
    code, _, err = decode(capsys, *common, "--tree", 6, "--tree-width", 2, "--out", tmp_path / "tree.jsonl",
                          "--stats-json", tmp_path / "s.json")  # fmt: skip
    assert code == 0, err
    assert "a draft tree of 6 nodes, depth 3" in err
    code, _, err = decode(capsys, *common, "--no-mtp", "--out", tmp_path / "plain.jsonl")
    assert code == 0, err
    rows = [(tmp_path / name).read_text().splitlines() for name in ("tree.jsonl", "plain.jsonl")]
    assert [json.loads(r)["token_ids"] for r in rows[0]] == [json.loads(r)["token_ids"] for r in rows[1]]
    stats = json.loads((tmp_path / "s.json").read_text())
    assert (stats["tree"], stats["num_draft"], len(stats["acceptance_per_position"])) == (6, 3, 3)
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["mean_accepted_depth"])


@pytest.mark.slow
def test_default_drafts_follow_the_platform(checkpoints, capsys, tmp_path, monkeypatch):
    """Without --num-draft a model with a head drafts on a CPU as the round costs and acceptance timed once on this
    machine say (then read back: no second timing), named in the summary; three drafts a round elsewhere; a model
    without a head none."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    stats = tmp_path / "s.json"
    common = ["--prompts-file", checkpoints / "prompts.jsonl", "--max-new-tokens", 4, "--stats-json", stats]
    code, _, err = decode(capsys, "--model", checkpoints / "with_head", *common)
    assert code == 0 and "timing this device's decoding once" in err
    drafting = json.loads(stats.read_text())["drafting"]
    assert "measured now" in drafting and drafting in err
    assert drafting.startswith(("1 draft(s) a round", "2 draft(s) a round", "plain decoding"))
    code, _, err = decode(capsys, "--model", checkpoints / "with_head", *common)
    assert code == 0 and "timing" not in err
    assert "measured here earlier" in json.loads(stats.read_text())["drafting"]
    code, _, _ = decode(capsys, "--model", checkpoints / "with_head", *common, "--num-draft", 1)
    assert code == 0 and "drafting" not in json.loads(stats.read_text())  # the options chose
    args = decode_cli.build_parser().parse_args(["--prompt", "x"])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert decode_cli.choose_num_draft(args, has_mtp=True) == 3
    assert decode_cli.choose_num_draft(args, has_mtp=False) == 0


@pytest.mark.slow
def test_a_missing_row_kernel_is_said_once(checkpoints, capsys, monkeypatch):
    """A CPU run whose row kernel could not be built says so in one line (it decodes on XLA); one the user turned
    off with MTP_JAX_NATIVE=0 does not."""
    monkeypatch.setattr(cpu_rows, "status", lambda: "off (no C++ compiler 'g++')")
    args = [
        "--model",
        checkpoints / "with_head",
        "--prompts-file",
        checkpoints / "prompts.jsonl",
        "--max-new-tokens",
        2,
    ]
    code, _, err = decode(capsys, *args)
    assert code == 0 and err.count("the CPU row kernel is off (no C++ compiler 'g++')") == 1, err
    monkeypatch.setenv(cpu_rows.DISABLE_ENV, "0")
    code, _, err = decode(capsys, *args)
    assert code == 0 and "row kernel" not in err, err


@pytest.mark.slow
def test_model_without_head_decodes_plainly_with_a_note(checkpoints, capsys):
    code, out, err = decode(
        capsys, "--model", checkpoints / "no_head", "--prompts-file", checkpoints / "prompts.jsonl",
        "--max-new-tokens", 4, "--dtype", "float32",
    )  # fmt: skip
    assert code == 0 and "no MTP head" in err
    assert len(out.splitlines()) == 5
    code, _, err = decode(
        capsys, "--model", checkpoints / "no_head", "--prompts-file", checkpoints / "prompts.jsonl",
        "--num-draft", 2,
    )  # fmt: skip
    assert code == 1 and "no MTP head" in err


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], "no prompts"),
        ('{"text": "x"}\n', [], "expected"),
        ("{not json\n", [], "invalid JSON"),
        ('{"token_ids": [1, 99]}\n', [], "outside the vocabulary"),
        ('{"token_ids": ' + json.dumps(list(range(3, 40)) * 2) + "}\n", [], "context is 64"),
        ('{"token_ids": [5]}\n', ["--temperature", "-1"], "--temperature"),
        ('{"token_ids": [5]}\n', ["--top-p", "0"], "--top-p"),
        ('{"token_ids": [5]}\n', ["--mesh", "data=2"], "--mesh"),
        ('{"token_ids": [5]}\n', ["--tree", "2"], "holds at least 3 nodes"),
        ('{"token_ids": [5]}\n', ["--tree", "8", "--no-mtp"], "not with --no-mtp"),
        ('{"token_ids": [5]}\n', ["--tree", "8", "--adaptive", "--round-costs", "1,2,3,4"], "needs 5 positive numbers"),
    ],
)
def test_bad_input_is_one_line(checkpoints, capsys, tmp_path, content, extra, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    out_path = tmp_path / "out.jsonl"
    code, out, err = decode(
        capsys, "--model", checkpoints / "with_head", "--prompts-file", path, "--out", out_path, *extra
    )
    assert code == 1
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert out == "" and not out_path.exists()


def test_a_tree_under_invariance_without_the_attention_kernel_is_one_line(checkpoints, capsys, tmp_path, monkeypatch):
    """Where no attention kernel takes a tree's mask batch-invariantly (a GPU, a CPU without the row kernel), a tree
    under --invariant is refused before anything is decoded; on this CPU with the kernel it decodes."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"token_ids": [5, 6]}\n')
    settings = ["--tree", "8", "--invariant", "--max-new-tokens", "8", "--prompts-file", path]
    if execution_plan.invariant_trees(traced_plan.resolve(invariant=True)):
        code, out, err = decode(capsys, "--model", checkpoints / "with_head", *settings, "--out", tmp_path / "a.jsonl")
        assert code == 0, err
    monkeypatch.setattr(execution_plan, "invariant_trees", lambda plan: False)
    code, out, err = decode(capsys, "--model", checkpoints / "with_head", *settings, "--out", tmp_path / "b.jsonl")
    assert code == 1 and "batch-invariant" in err and len(err.strip().splitlines()) == 1, err
    assert out == "" and not (tmp_path / "b.jsonl").exists()


def test_missing_model_and_bad_option_values(checkpoints, capsys, tmp_path):
    code, _, err = decode(capsys, "--model", tmp_path / "nope", "--prompt", "hi")
    assert code == 1 and "no such model" in err
    with pytest.raises(SystemExit) as exit_info:
        decode_main(["--model", str(checkpoints / "with_head"), "--prompt", "hi", "--max-new-tokens", "0"])
    assert exit_info.value.code == 2
    assert "--max-new-tokens" in capsys.readouterr().err


class Terminal(io.StringIO):
    """A stdout that says it is a terminal (or, with `tty=False`, that it is not)."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.slow
def test_terminal_gets_text_blocks_and_pipes_get_jsonl(checkpoints, capsys, monkeypatch, tmp_path):
    common = ["--model", str(checkpoints / "with_head"), "--prompts-file", str(checkpoints / "prompts.jsonl")]
    common += ["--max-new-tokens", "6", "--dtype", "float32"]
    assert decode_main([*common, "--out", str(tmp_path / "rows.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    expected_jsonl = (tmp_path / "rows.jsonl").read_text()
    shown = {}
    for tty in (True, False):
        monkeypatch.setattr(sys, "stdout", Terminal(tty))
        assert decode_main(common) == 0
        shown[tty] = sys.stdout.getvalue()
    monkeypatch.undo()
    assert "mean accepted length" in capsys.readouterr().err  # the summary stays on stderr
    assert shown[False] == expected_jsonl  # a pipe: JSONL, byte for byte as with --out
    blocks = shown[True].split("\n\n")
    assert len(blocks) == len(rows) == 5
    for i, (block, row) in enumerate(zip(blocks, rows, strict=True)):
        header, answer = block.strip("\n").split("\n")
        assert header == f"=== [{i + 1}/5] {json.dumps(row['prompt'])} ==="
        assert answer == f"token ids: {json.dumps(row['token_ids'])}"  # this checkpoint has no tokenizer


def test_terminal_text_of_one_prompt_and_of_several():
    row = {"index": 0, "prompt": "Say hi\n  twice", "text": "hi hi", "token_ids": [7, 7], "num_tokens": 2}
    assert terminal_text(row, 1) == "hi hi\n"
    assert terminal_text(row, 2) == "=== [1/2] Say hi twice ===\nhi hi\n"
    long = {**row, "index": 1, "prompt": "x" * 80}
    assert terminal_text(long, 2) == f"\n=== [2/2] {'x' * 59}… ===\nhi hi\n"


class CountingTerminal(Terminal):
    """A terminal stdout that keeps each write apart."""

    def __init__(self):
        super().__init__(tty=True)
        self.writes = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.mark.slow
def test_a_lone_prompt_streams_to_a_terminal(smollm2_path, capsys, monkeypatch, tmp_path):
    """On a terminal the answer appears in pieces as it is generated; joined, it is the answer a pipe gets."""
    common = ["--model", smollm2_path, "--prompt", "Name three colours.", "--max-new-tokens", "24", "--num-draft", "0"]
    stats_json = tmp_path / "stats.json"
    assert decode_main([*common, "--out", str(tmp_path / "row.jsonl")]) == 0
    row = json.loads((tmp_path / "row.jsonl").read_text())
    monkeypatch.setattr(sys, "stdout", CountingTerminal())
    assert decode_main([*common, "--stats-json", str(stats_json)]) == 0
    writes = sys.stdout.writes
    monkeypatch.undo()
    assert row["text"] and "".join(writes) == row["text"] + "\n"
    assert len(writes) > 2, writes  # pieces of 16 tokens, then the line's end
    stats = json.loads(stats_json.read_text())
    assert stats["generated_tokens"] == row["num_tokens"] and stats["compile_seconds"] > 0
    assert "tokens/s" in capsys.readouterr().err


@pytest.mark.slow
def test_int8_activations_decode_mtp_equal_to_plain_and_need_4bit_weights(checkpoints, capsys):
    common = ["--model", checkpoints / "with_head", "--prompts-file", checkpoints / "prompts.jsonl"]
    common += ["--max-new-tokens", 10, "--dtype", "float32", "--weights", "int4", "--activations", "int8"]
    outputs = []
    for k in (0, 2):
        code, out, err = decode(capsys, *common, "--num-draft", k)
        assert code == 0, err
        outputs.append([json.loads(line)["token_ids"] for line in out.splitlines()])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5
    code, out, err = decode(capsys, *common[:-4], "--weights", "int8", "--activations", "int8")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1 and "needs weights in blocks" in err


def test_partial_files_are_named_by_the_tree(tmp_path):
    """A tree's rows (sampled) depend on its budget and width, so its partial file's name does; a chain's keeps the
    name its settings gave it before trees (a run started then still resumes)."""
    parser = decode_cli.build_parser()

    def digest(*extra):  # each in a folder of its own: a partial file is made at once
        out = tmp_path / str(len(list(tmp_path.iterdir()))) / "o.jsonl"
        args = parser.parse_args(["--prompt", "x", "--out", str(out), *extra])
        return RowOutput(args, ["x"]).partial.rsplit("-", 1)[1], args

    (chain, args), (tree, _), (narrower, _) = (
        digest(),
        digest("--tree", "8"),
        digest("--tree", "8", "--tree-width", "2"),
    )
    assert len({chain, tree, narrower}) == 3
    before_trees = {k: getattr(args, k) for k in ROW_SETTINGS if k not in ("tree", "tree_width")}
    assert chain == hashlib.sha256(json.dumps(before_trees, sort_keys=True).encode()).hexdigest()[:12]
