"""Runs in its own process with 8 CPU devices (tests/test_sharding.py starts it with XLA_FLAGS set).

Decodes a tiny model on one device and on meshes 1x8, 2x4, 8x1 (and adaptively on 2x4), a tiny DeepSeek-V3
(latent attention, routed experts) on one device and on data=2,expert=2,model=2, loads the first onto a mesh from a
Hugging Face folder, from a converted folder and with a separately saved MTP head, and writes what it saw (tokens,
shardings, shard shapes, the all-gathers of every compiled program) as JSON for the test's assertions.
Usage, from the repository root: python -m tests.sharded_worker OUT.json WORKDIR
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax
from checkpoints_convert.__main__ import main as convert_main
from checkpoints_convert.export import save_hf_folder
from mtp_jax import heads, shapes, sharding
from mtp_jax.config import MtpConfig
from tests.hybrid_models import predictable_hybrid_model
from tests.tiny_models import predictable_model, tiny_config

MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")  # all model, mixed, all data
DRAFTS = (0, 2)
ADAPTIVE_MESH = "data=2,model=4"  # adaptive rounds (j = 0 or 1 drafts, picked on device) on this mesh
MOE_MESH = "data=2,expert=2,model=2"  # the DeepSeek-V3 model decodes with one draft per round on this mesh
HYBRID_MESH = "data=2,model=4"  # a Qwen3.5-shaped hybrid (DeltaNet states rolled back by selection), two drafts
NEW_TOKENS = 24
LENS = np.array([1, 7, 4, 10, 3, 9, 2, 5], np.int32)
IDS = np.where(np.arange(10) < LENS[:, None], np.random.default_rng(1).integers(0, 24, (8, 10)), 0).astype(np.int32)


def sharded_config():
    """tiny_config with 8 query heads (divisible by every model axis here) over 2 kv heads (replicated on 4 and 8)."""
    return tiny_config().replace(num_heads=8, head_dim=4)


def all_gather_shapes(hlo: str) -> list[list[int]]:
    """Result shapes of every all-gather in compiled HLO text."""
    shapes = []
    for line in hlo.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-gather(?:-start)?\(", line)
        if match:
            shapes += [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\w+\[([\d,]*)\]", match[1])]
    return shapes


def decode(model, k: int, adaptive: bool = False):
    """(output as lists, the compiled program's text) of greedy decoding IDS."""
    graphdef, params = nnx.split(model)
    costs = (1.0, 1.2) if adaptive else None  # cheap drafts, so the policy drafts (whatever a tiny model's bytes say)
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=NEW_TOKENS, adaptive=adaptive, round_costs=costs)
    run = jax.jit(lambda p, i, n: mtp_jax.generate(nnx.merge(graphdef, p), i, n, jax.random.key(0), cfg))
    compiled = run.lower(params, IDS, LENS).compile()
    out = compiled(params, IDS, LENS)
    result = {
        "tokens": np.asarray(out.tokens).tolist(),
        "lengths": np.asarray(out.lengths).tolist(),
        "finished": np.asarray(out.finished_by_eos).tolist(),
        "accepted": int(out.stats.accepted),
        "tokens_spec": spec_list(out.tokens),
    }
    return result, compiled.as_text()


def spec_list(x: jax.Array) -> list | None:
    """x's PartitionSpec as JSON (mesh axis names, lists of them, None); None off a mesh."""
    spec = getattr(x.sharding, "spec", None)
    return None if spec is None else [s if s is None or isinstance(s, str) else list(s) for s in spec]


def flat_params(model) -> dict[str, jax.Array]:
    return {"/".join(str(p) for p in path): v[...] for path, v in nnx.to_flat_state(nnx.state(model))}


def describe_params(model) -> list[dict]:
    return [
        {
            "path": path,
            "shape": list(value.shape),
            "spec": spec_list(value),
            "shard_shapes": sorted({tuple(s.data.shape) for s in value.addressable_shards}),
        }
        for path, value in flat_params(model).items()
    ]


def cache_spec(model) -> list:
    """The PartitionSpec of every trunk cache array made inside jit under the model's rules."""
    with sharding.activate(model.sharding_rules):
        cache = jax.jit(lambda: model.new_cache(8, 32))()
    return [spec_list(x) for x in jax.tree.leaves(cache)]


def same_placement(a, b) -> dict:
    pa, pb = flat_params(a), flat_params(b)
    return {
        "same_paths": sorted(pa) == sorted(pb),
        "same_values": all(np.array_equal(np.asarray(pa[k]), np.asarray(pb[k])) for k in pa),
        "same_shardings": all(pa[k].sharding == pb[k].sharding for k in pa),
        "same_rules": a.sharding_rules == b.sharding_rules,
    }


def mesh_report(model, spec: str, k: int) -> dict:
    """`model` decoded with k drafts on one device and on mesh `spec`: outputs, parameter shards, cache layout."""
    reference, _ = decode(model, k)
    sharded = sharding.shard_model(model, sharding.make_mesh(spec))
    result, hlo = decode(sharded, k)
    return {
        "reference": reference,
        "run": {**result, "all_gathers": all_gather_shapes(hlo)},
        "params": describe_params(sharded),
        "cache": cache_spec(sharded),
    }


def load_with_head(model, hf: str, head_dir: str, mesh) -> dict:
    """A head saved apart (with a draft vocabulary) attached while loading onto `mesh`, against attaching it to the
    model in memory and sharding the result."""
    cfg = model.config.replace(mtp=MtpConfig(draft_vocab_size=16))
    headed = mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(7))
    headed.draft_vocab[...] = jnp.asarray(np.random.default_rng(7).permutation(cfg.vocab_size)[:16], jnp.int32)
    heads.save_head(headed, head_dir)
    loaded = mtp_jax.load_model(hf, dtype=jnp.float32, mesh=mesh, head=head_dir)
    return same_placement(loaded, sharding.shard_model(heads.attach_head(model, head_dir), mesh))


def main(out_path: str, workdir: str) -> None:
    assert jax.device_count() == 8, f"expected 8 CPU devices (XLA_FLAGS), got {jax.devices()}"
    model = predictable_model(seed=3, cfg=sharded_config())
    report: dict = {"devices": jax.device_count(), "reference": {}, "runs": [], "params": {}, "caches": {}}
    for k in DRAFTS:
        report["reference"][str(k)], _ = decode(model, k)
    for spec in MESHES:
        sharded = sharding.shard_model(model, sharding.make_mesh(spec))
        report["params"][spec] = describe_params(sharded)
        report["caches"][spec] = cache_spec(sharded)
        for k in DRAFTS:
            result, hlo = decode(sharded, k)
            report["runs"].append({"mesh": spec, "k": k, **result, "all_gathers": all_gather_shapes(hlo)})

    adaptive = sharding.shard_model(model, sharding.make_mesh(ADAPTIVE_MESH))
    report["adaptive"], _ = decode(adaptive, 1, adaptive=True)
    # a random tiny DeepSeek-V3 (MLA, 16 routed experts in trunk and MTP layer); a predictable hybrid trunk (gated
    # DeltaNet + gated attention groups, states rolled back by selection)
    report["moe"] = mesh_report(mtp_jax.CausalLM(shapes.deepseek_v3_tiny(), rngs=nnx.Rngs(0)), MOE_MESH, 1)
    report["hybrid"] = mesh_report(predictable_hybrid_model(6), HYBRID_MESH, 2)

    try:
        mtp_jax.generate(sharding.shard_model(model, sharding.make_mesh("data=4,model=2")), IDS[:6], LENS[:6], None)
        report["batch_error"] = None
    except ValueError as e:
        report["batch_error"] = str(e)

    mesh = sharding.make_mesh("data=2,model=4")

    # A weight read back whole on every device: the all-gather the check must catch.
    rules = sharding.ShardingRules(mesh)
    weight = sharding.place_host_array(np.ones((32, 64), np.float32), rules.param_sharding(("gate_proj",), (32, 64)))
    gathered = jax.jit(lambda w, x: x @ jax.lax.with_sharding_constraint(w, rules.sharding((None, None))))
    report["control_all_gathers"] = all_gather_shapes(gathered.lower(weight, jnp.ones((4, 32))).compile().as_text())

    hf, converted = os.path.join(workdir, "hf"), os.path.join(workdir, "converted")
    save_hf_folder(model, hf)
    assert convert_main([hf, converted, "--dtype", "float32"]) == 0
    expected = sharding.shard_model(model, mesh)
    report["loaded"] = {
        "hf": same_placement(mtp_jax.load_model(hf, dtype=jnp.float32, mesh=mesh), expected),
        "converted": same_placement(mtp_jax.load_model(converted, dtype=jnp.float32, mesh=mesh), expected),
        "head": load_with_head(model, hf, os.path.join(workdir, "head"), mesh),
    }
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
