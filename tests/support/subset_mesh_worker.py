"""Runs in its own process with 8 CPU devices (tests/parallel/test_subset_mesh.py starts it with XLA_FLAGS set).

Builds the mesh data=1,model=4 over the first 4 of the 8 devices, decodes a tiny model greedily (two drafts a round)
on one device and on that mesh, asks for the same mesh as if this were one of two processes, streams one prompt's
answer on one device and on data=2,model=2 (the row repeated over the data shards), and writes what it saw
as JSON for the test's assertions. Usage, from the repository root: python -m tests.support.subset_mesh_worker OUT.json
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from flax import nnx

import mtp_jax
from mtp_jax.decode import speculative
from mtp_jax.parallel import sharding
from tests.support.tiny_models import predictable_model, tiny_config

SPEC = "data=1,model=4"
LENS = np.array([1, 7, 4, 10], np.int32)
IDS = np.where(np.arange(10) < LENS[:, None], np.random.default_rng(1).integers(0, 24, (4, 10)), 0).astype(np.int32)


def greedy(model) -> dict:
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=16)
    out = mtp_jax.generate(model, IDS, LENS, jax.random.key(0), cfg)
    return {
        "tokens": np.asarray(out.tokens).tolist(),
        "lengths": np.asarray(out.lengths).tolist(),
        "devices": sorted(d.id for d in out.tokens.devices()),
    }


class WordTokenizer:
    """Token i is the word "w<i>"; no chat template."""

    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)


def streamed(model) -> dict:
    """One prompt's answer through `stream_text` (in pieces of 5 tokens) and through `generate_text`."""
    cfg, prompt, tokenizer = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=16), [5, 6, 7], WordTokenizer()
    pieces = list(mtp_jax.stream_text(model, prompt, cfg, tokenizer=tokenizer, chunk_tokens=5))
    return {"pieces": pieces, "text": mtp_jax.generate_text(model, [prompt], cfg, tokenizer=tokenizer).texts[0]}


def compiled_chunks(model) -> list:
    """The last output's tokens of `generate_chunks` compiled ahead (as decode streams to a terminal)."""
    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=16)
    ids, lens = np.concatenate([IDS[:1], IDS[:1]]), np.concatenate([LENS[:1], LENS[:1]])  # two rows: data=2
    program = speculative.compile_chunks(model, ids, lens, jax.random.key(0), cfg)
    pieces = list(program(model, ids, lens, jax.random.key(0), cfg, chunk_tokens=5))
    return np.asarray(pieces[-1].tokens).tolist()


def multi_process_error() -> str:
    """make_mesh's error for SPEC when jax says there are two processes (the rule of a multi-process run)."""
    real = jax.process_count
    jax.process_count = lambda: 2
    try:
        sharding.make_mesh(SPEC)
    except ValueError as e:
        return str(e)
    finally:
        jax.process_count = real
    return ""


def main(out_path: str) -> None:
    assert jax.device_count() == 8, f"expected 8 CPU devices (XLA_FLAGS), got {jax.devices()}"
    mesh = sharding.make_mesh(SPEC)
    model = predictable_model(seed=3, cfg=tiny_config().replace(num_heads=8, head_dim=4))
    sharded = sharding.shard_model(model, mesh)
    report = {
        "mesh_shape": dict(mesh.shape),
        "mesh_devices": [d.id for d in mesh.devices.flat],
        "first_devices": [d.id for d in jax.devices()[:4]],
        "param_devices": sorted({d.id for leaf in jax.tree.leaves(nnx.state(sharded)) for d in leaf.devices()}),
        "one_device": greedy(model),
        "mesh": greedy(sharded),
        "multi_process_error": multi_process_error(),
        "streamed_one_device": streamed(model),
        "streamed_data_mesh": streamed(sharding.shard_model(model, sharding.make_mesh("data=2,model=2"))),
        "compiled_chunks_one_device": compiled_chunks(model),
        "compiled_chunks_data_mesh": compiled_chunks(sharding.shard_model(model, sharding.make_mesh("data=2,model=2"))),
    }
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
