"""Runs in child processes with 8 CPU devices, one per section of SECTIONS (`run_section` starts them with XLA_FLAGS
set, for tests/parallel/test_sharding.py, tests/parallel/test_expert_parallel.py and
tests/parallel/test_slot_sharded_caches.py).

Decodes a tiny model on one device and on meshes 1x8, 2x4, 8x1 (and adaptively on 2x4), a tiny DeepSeek-V3
(latent attention, routed experts) on one device and on data=2,expert=2,model=2, DeepSeek-V3, GLM-4.5 and a
Qwen3.5-MoE-shaped hybrid with their experts spread over `expert` (4 or 8 shards; the rows go to the experts inside
shard_map), compares the routed-experts layers on expert meshes with one device, loads the first model onto a mesh
from a Hugging Face folder, from a converted folder and with a separately saved MTP head, and writes what it saw
(tokens, shardings, shard shapes, the all-gathers of every compiled program) as JSON for the tests' assertions.
Usage, from the repository root: python -m tests.support.sharded_worker SECTION OUT.json WORKDIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax
from checkpoints_convert.__main__ import main as convert_main
from mtp_jax.config import execution_plan
from mtp_jax.config.model import MoeConfig, MtpConfig
from mtp_jax.conversion.export import save_hf_folder
from mtp_jax.decode.engine import Engine, Request
from mtp_jax.kernels import traced_plan
from mtp_jax.loading import heads
from mtp_jax.models.cache_attention import ATTENTION_CHUNK, default_attention, grouped_attention
from mtp_jax.models.kv_cache import cache_slots, long_cache_shards
from mtp_jax.models.mla import MultiHeadLatentAttention
from mtp_jax.models.moe import MoE
from mtp_jax.models.softmax_moe import SoftmaxMoE
from mtp_jax.parallel import sharding
from mtp_jax.plan import shapes
from tests.support.commands import ROOT, cpu_env
from tests.support.hybrid_models import hybrid_config, predictable_hybrid_model
from tests.support.tiny_models import predictable_model, predictable_moe_model, tiny_config

MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")  # all model, mixed, all data
DRAFTS = (0, 2)
ADAPTIVE_MESH = "data=2,model=4"  # adaptive rounds (j = 0 or 1 drafts, picked on device) and a tree on this mesh
TREE_NODES = 8
MOE_MESH = "data=2,expert=2,model=2"  # the DeepSeek-V3 model decodes with one draft per round on this mesh
HYBRID_MESH = "data=2,model=4"  # a Qwen3.5-shaped hybrid (DeltaNet states rolled back by replay), two drafts
EXPERT_RUNS = (  # (model, mesh, drafts): expert parallelism, each shard running its experts over every row it sees
    ("deepseek_v3", "data=1,expert=4,model=2", (0, 2)),
    ("deepseek_v3", "data=2,expert=4,model=1", (2,)),
    ("glm4_moe", "data=1,expert=8,model=1", (2,)),  # plain decoding on an expert mesh: DeepSeek-V3's run
    ("qwen3_5_moe", "data=2,expert=2,model=2", (2,)),
)
LAYER_MESHES = (
    "data=1,expert=8,model=1",
    "data=2,expert=4,model=1",
    "data=1,expert=4,model=2",
    "data=2,expert=2,model=2",
)
NEW_TOKENS = 24
LENS = np.array([1, 7, 4, 10, 3, 9, 2, 5], np.int32)
IDS = np.where(np.arange(10) < LENS[:, None], np.random.default_rng(1).integers(0, 24, (8, 10)), 0).astype(np.int32)
# Long prompts on meshes whose `model` axis cannot split the attention caches' heads (2 kv heads on model=4; MLA's
# latents, whose slots split over `expert` where the mesh has one, the heads over `model` beside them): the caches
# split over their slots, 4 shards of 256 (SLOT_SHARDS); rows end in the first three shards, some decoding across the
# shard boundaries at slots 256 and 512.
SLOT_MESHES = {"gqa": "data=2,model=4", "hybrid": "data=2,model=4", "latent": "data=1,expert=4,model=2"}
SLOT_SHARDS = 4
SLOT_DRAFTS = (3,)  # a verify block, a draft step and the prefill (plain steps' attention is a block of one)
LONG_NEW_TOKENS = 8
LONG_LENS = np.array([600, 254, 40, 510, 3, 300, 509, 100], np.int32)
LONG_IDS = np.random.default_rng(2).integers(0, 24, (8, 600)).astype(np.int32) * (np.arange(600) < LONG_LENS[:, None])


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


def decode(model, k: int, adaptive: bool = False, ids=IDS, lens=LENS, new_tokens: int = NEW_TOKENS, tree: int = 0,
           plan=None):  # fmt: skip
    """(output as lists, the compiled program's text) of greedy decoding `ids` (IDS unless given); `tree`: a draft
    tree's node budget (k deep, 3 wide); `plan`: an execution plan (default: the one resolved for the mesh)."""
    graphdef, params = nnx.split(model)
    costs = (1.0, 1.2) if adaptive else None  # cheap drafts, so the policy drafts (whatever a tiny model's bytes say)
    cfg = mtp_jax.DecodeConfig(num_draft=k, max_new_tokens=new_tokens, adaptive=adaptive, round_costs=costs,
                               tree=tree, tree_width=3, plan=plan)  # fmt: skip
    run = jax.jit(lambda p, i, n: mtp_jax.generate(nnx.merge(graphdef, p), i, n, jax.random.key(0), cfg))
    lowered = run.lower(params, ids, lens)
    compiled = lowered.compile()
    out = compiled(params, ids, lens)
    result = {
        "shard_maps": lowered.as_text().count("sdy.manual_computation"),  # shard_map calls: experts on an expert mesh
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


def delta_rule_kernel_report(model, spec: str, k: int, **settings) -> dict:
    """`model` decoded with k drafts (and DecodeConfig `settings`) on mesh `spec` under a plan that names the
    delta-rule kernel (Pallas' interpreter on these CPU devices): its outputs, and its program's shard_map calls (the
    kernel runs per shard)."""
    sharded = sharding.shard_model(model, sharding.make_mesh(spec))
    plan = traced_plan.resolve(sharded.sharding_rules)
    plan = dataclasses.replace(plan, delta_rule=execution_plan.DeltaRule.PALLAS)
    result, _ = decode(sharded, k, plan=plan, **settings)
    return result


def qwen3_5_moe_config():
    """tests/support/hybrid_models.py's hybrid config with Qwen3.5-MoE's MLP: 8 softmax-routed experts (top 2), a gated
    shared expert."""
    moe = MoeConfig(
        num_experts=8, experts_per_token=2, expert_intermediate_size=16, scoring="softmax", shared_intermediate_size=32
    )
    return hybrid_config().replace(family="qwen3_5_moe_text", moe=moe)


def predictable_qwen3_5_moe_model(seed: int = 6) -> mtp_jax.CausalLM:
    """predictable_hybrid_model with experts: the routed experts' outputs scaled down as the other MLP outputs are
    (0.3 in the trunk, 0.02 in the MTP layer), so the MTP head's drafts are often right."""
    model = predictable_hybrid_model(seed, cfg=qwen3_5_moe_config())
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and str(path[-1]) == "expert_down":
            node[...] = node[...] * (0.02 if str(path[0]) == "mtp" else 0.3)
    return model


def expert_models() -> dict[str, mtp_jax.CausalLM]:
    return {
        "deepseek_v3": predictable_moe_model("deepseek_v3"),
        "glm4_moe": predictable_moe_model("glm4_moe"),
        "qwen3_5_moe": predictable_qwen3_5_moe_model(),
    }


def expert_parallel_report() -> dict:
    """EXPERT_RUNS decoded on one device and on their meshes: outputs, parameter shards, all-gathers."""
    models = expert_models()
    drafts = {name: sorted({k for model, _, ks in EXPERT_RUNS if model == name for k in ks}) for name in models}
    references = {name: {str(k): decode(models[name], k)[0] for k in drafts[name]} for name in models}
    runs = []
    for name, spec, drafts in EXPERT_RUNS:
        sharded = sharding.shard_model(models[name], sharding.make_mesh(spec))
        for k in drafts:
            result, hlo = decode(sharded, k)
            runs.append({"model": name, "mesh": spec, "k": k, **result, "all_gathers": all_gather_shapes(hlo)})
        runs[-1]["params"] = describe_params(sharded)
    return {"reference": references, "runs": runs}


def layer_report() -> list[dict]:
    """The routed-experts layers (sigmoid and softmax routing, float32) on one device and on expert meshes, where
    the rows go to the experts inside shard_map: many rows (every expert shard gets some) and two rows (some get
    none); which shards got rows, and how many shard_maps and psums the traced layer holds."""
    results = []
    layers = (MoE(shapes.deepseek_v3_tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0)),)
    layers += (SoftmaxMoE(qwen3_5_moe_config(), dtype=jnp.float32, rngs=nnx.Rngs(0)),)
    for layer in layers:
        n, d = layer.routing.num_experts, layer.router.shape[0]
        for rows in (32, 2):
            x = jax.random.normal(jax.random.key(rows), (2, rows // 2, d), jnp.float32)  # [B, T, D]
            reference = np.asarray(jax.jit(lambda x, layer=layer: layer(x))(x))
            picked = np.asarray(layer.route(x.reshape(-1, d))[1])  # [M, O] expert ids
            for spec in LAYER_MESHES:
                sharded = sharding.shard_model(layer, sharding.make_mesh(spec))
                graphdef, params = nnx.split(sharded)

                def run(params, x, graphdef=graphdef, rules=sharded.sharding_rules):
                    with sharding.activate(rules):
                        return nnx.merge(graphdef, params)(x)

                jaxpr = str(jax.make_jaxpr(run)(params, x))
                ep = sharded.sharding_rules.axis_size("experts")
                results.append(
                    {
                        "layer": type(layer).__name__,
                        "mesh": spec,
                        "rows": rows,
                        "max_error": float(np.abs(np.asarray(jax.jit(run)(params, x)) - reference).max()),
                        "shards_with_rows": sorted({int(i) // (n // ep) for i in picked.reshape(-1)}),
                        "expert_shards": ep,
                        "shard_maps": jaxpr.count("shard_map["),
                        "psums": len(re.findall(r"\bpsum\w*\[", jaxpr)),
                    }
                )
    return results


def slot_sharded_report() -> dict:
    """LONG_IDS decoded with SLOT_DRAFTS drafts on one device and on SLOT_MESHES (GQA with 2 kv heads, a hybrid, a
    DeepSeek-V3 with latent attention): outputs, all-gathers, whether the compiled decode holds each device's block
    of the caches or caches with all their slots, and the attention caches (trunk, MTP layer) as made for that decode:
    slots, shapes, specs, shard shapes."""
    models = {
        "gqa": predictable_model(seed=3, cfg=sharded_config()),
        "hybrid": predictable_hybrid_model(6),
        "latent": predictable_moe_model("deepseek_v3"),
    }
    long = dict(ids=LONG_IDS, lens=LONG_LENS, new_tokens=LONG_NEW_TOKENS)
    report = {}
    for name, model in models.items():
        sharded = sharding.shard_model(model, sharding.make_mesh(SLOT_MESHES[name]))
        cfg = mtp_jax.DecodeConfig(num_draft=max(SLOT_DRAFTS), max_new_tokens=LONG_NEW_TOKENS)
        shards = long_cache_shards(model.config, sharded.sharding_rules)
        slots = cache_slots(LONG_IDS.shape[1], cfg, shards)
        caches = [describe_cache(x) for x in new_caches(sharded, slots) if x.shape[2] == slots]  # not DeltaNet states
        entry: dict = {"reference": {}, "runs": {}, "slots": slots, "caches": caches}
        for k in SLOT_DRAFTS:
            entry["reference"][str(k)], _ = decode(model, k, **long)
            result, hlo = decode(sharded, k, **long)
            blocks = {f"{c['dtype']}[{','.join(map(str, shape))}]" for c in caches for shape in c["shard_shapes"]}
            whole = {f"{c['dtype']}[{c['shape'][0]},{c['shard_shapes'][0][1]},{','.join(map(str, c['shape'][2:]))}]"
                     for c in caches}  # fmt: skip  # a device's rows with every slot
            result["cache_blocks_in_program"] = all(block in hlo for block in blocks)
            result["whole_caches_in_program"] = any(shape in hlo for shape in whole)
            entry["runs"][str(k)] = {**result, "all_gathers": all_gather_shapes(hlo)}
        report[name] = entry
    return report


def new_caches(model, slots: int) -> list[jax.Array]:
    """The arrays of the trunk's and the MTP layer's caches for 8 rows, made inside jit under the model's rules."""
    with sharding.activate(model.sharding_rules):
        return jax.tree.leaves(jax.jit(lambda: (model.new_cache(8, slots), model.new_mtp_cache(8, slots)))())


def describe_cache(x: jax.Array) -> dict:
    return {
        "shape": list(x.shape),
        "dtype": {"float32": "f32", "bfloat16": "bf16"}[x.dtype.name],  # as compiled HLO writes it
        "spec": spec_list(x),
        "shard_shapes": sorted({s.data.shape for s in x.addressable_shards}),
    }


def slot_attention_report() -> dict:
    """Attention over a cache split over its slots (data=2,model=4: 4 shards of 2 chunks) against one pass over the
    same visible slots, on random float32 inputs, rows starting in every shard: grouped-query attention, latent
    attention absorbed and expanded. Max errors, and the slot shards each saw."""
    rules = sharding.ShardingRules(sharding.make_mesh("data=2,model=4"))
    rng = np.random.default_rng(0)
    b, t, n, kv, h, slots = 4, 3, 8, 2, 8, 4 * 2 * ATTENTION_CHUNK
    positions = (np.array([5, 600, 1300, 2000])[:, None] + np.arange(t)).astype(np.int32)
    visible_from = np.array([0, 3, 520, 0], np.int32)
    one_pass = slots - 16  # not whole chunks: attended in one pass (every visible slot is below it)

    def on_mesh(attend, layout):  # attend(*caches) with the caches split over their slots
        def run(*caches):
            with sharding.activate(rules):
                caches = [sharding.constrain_cache(c, layout, ATTENTION_CHUNK) for c in caches]
                return attend(*caches), sharding.slot_shards(layout, caches[0].shape, ATTENTION_CHUNK)

        return jax.jit(run)

    q, k, v = (rng.normal(size=(b, t, heads, h)).astype(np.float32) for heads in (n, kv, kv))
    past_k, past_v = (rng.normal(size=(b, slots, kv, h)).astype(np.float32) for _ in range(2))

    def gqa(past_k, past_v):
        return grouped_attention(q, k, v, positions, past_k, past_v, visible_from, default_attention(past_k.shape[1]))

    got, gqa_shards = on_mesh(gqa, sharding.CACHE[1:])(past_k, past_v)
    errors = {"gqa": float(np.abs(got - gqa(past_k[:, :one_pass], past_v[:, :one_pass])).max())}

    cfg = shapes.deepseek_v3_tiny()
    layer = MultiHeadLatentAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = rng.normal(size=(b, t, cfg.hidden_size)).astype(np.float32)
    rope = tuple(rng.normal(size=(b, t, cfg.mla.qk_rope_head_dim)).astype(np.float32) for _ in range(2))
    latents = rng.normal(size=(b, slots, cfg.mla.latent_dim)).astype(np.float32)
    for absorb in (True, False):

        def mla(past, absorb=absorb):
            attention = default_attention(past.shape[1])
            return layer(x, positions, rope, past, absorb=absorb, visible_from=visible_from, attention=attention)[0]

        got, latent_shards = on_mesh(mla, sharding.LATENT_CACHE[1:])(latents)
        errors["latent_absorbed" if absorb else "latent_expanded"] = float(
            np.abs(got - mla(latents[:, :one_pass])).max()
        )
    return {"errors": errors, "shards": {"gqa": int(gqa_shards), "latent": int(latent_shards)}}


def drafting_model(cfg):
    """A random model of `cfg` whose MTP head drafts from 16 token ids (a draft vocabulary)."""
    drafting = mtp_jax.CausalLM(cfg.replace(mtp=MtpConfig(draft_vocab_size=16)), rngs=nnx.Rngs(7))
    drafting.draft_vocab[...] = jnp.asarray(np.random.default_rng(7).permutation(cfg.vocab_size)[:16], jnp.int32)
    return drafting


def load_with_head(model, hf: str, head_dir: str, mesh) -> dict:
    """A head saved apart (with a draft vocabulary) attached while loading onto `mesh`, against attaching it to the
    model in memory and sharding the result."""
    heads.save_head(drafting_model(model.config), head_dir)
    loaded = mtp_jax.load_model(hf, dtype=jnp.float32, mesh=mesh, head=head_dir)
    return same_placement(loaded, sharding.shard_model(heads.attach_head(model, head_dir), mesh))


def meshes_report(workdir: str) -> dict:
    """The dense model on MESHES (and adaptively), DeepSeek-V3 and a hybrid on their meshes, an uneven batch, the
    control program that gathers a weight, and loading onto a mesh."""
    model = predictable_model(seed=3, cfg=sharded_config())
    report: dict = {"reference": {}, "runs": [], "params": {}, "caches": {}}
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
    report["tree"], _ = decode(adaptive, 3, tree=TREE_NODES)  # a draft tree on the same data and model axes
    # a random tiny DeepSeek-V3 (MLA, 16 routed experts in trunk and MTP layer); a predictable hybrid trunk (gated
    # DeltaNet + gated attention groups, states rolled back by replay)
    moe_model = mtp_jax.CausalLM(shapes.deepseek_v3_tiny(), rngs=nnx.Rngs(0))
    report["moe"] = mesh_report(moe_model, MOE_MESH, 1)
    report["moe_tree"], _ = decode(sharding.shard_model(moe_model, sharding.make_mesh(MOE_MESH)), 2, tree=6)
    report["hybrid"] = mesh_report(predictable_hybrid_model(6), HYBRID_MESH, 2)
    report["hybrid_kernel"] = delta_rule_kernel_report(predictable_hybrid_model(6), HYBRID_MESH, 2)
    drafting = drafting_model(model.config)
    report["draft_vocab"] = mesh_report(drafting, ADAPTIVE_MESH, 2)
    report["draft_vocab_tree"], _ = decode(sharding.shard_model(drafting, sharding.make_mesh(ADAPTIVE_MESH)), 2, tree=6)
    hybrid_mesh = sharding.make_mesh(HYBRID_MESH)
    report["hybrid_tree"], _ = decode(sharding.shard_model(predictable_hybrid_model(6), hybrid_mesh), 2, tree=6)
    report["hybrid_kernel_tree"] = delta_rule_kernel_report(predictable_hybrid_model(6), HYBRID_MESH, 2, tree=6)

    try:
        mtp_jax.generate(sharding.shard_model(model, sharding.make_mesh("data=4,model=2")), IDS[:6], LENS[:6], None)
        report["batch_error"] = None
    except ValueError as e:
        report["batch_error"] = str(e)

    mesh = sharding.make_mesh("data=2,model=4")

    # A weight read back whole on every device: the all-gather the check must catch.
    rules = sharding.ShardingRules(mesh)
    weight = sharding.place_host_array(np.ones((32, 64), np.float32), rules.sharding(("embed", "mlp"), (32, 64)))
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
    return report


def engine_report() -> dict:
    """The dense model's engine with 4 slots over `data` (data=2,model=4), and hybrid's (its DeltaNet states reset
    per slot), 8 prompts through 4 slots with two drafts a round: each request's tokens, and one `generate` batch's
    on a single device."""
    report = {}
    models = {"gqa": predictable_model(seed=3, cfg=sharded_config()), "hybrid": predictable_hybrid_model(6)}
    for name, model in models.items():
        reference, _ = decode(model, 2)
        engine = Engine(sharding.shard_model(model, sharding.make_mesh("data=2,model=4")),
                        mtp_jax.DecodeConfig(num_draft=2), slots=4, max_len=int(LENS.max()) + NEW_TOKENS)  # fmt: skip
        ids = {engine.submit(Request(IDS[i, : LENS[i]].tolist(), NEW_TOKENS)): i for i in range(len(LENS))}
        tokens = {i: [] for i in range(len(LENS))}
        while engine.busy:
            for update in engine.step():
                tokens[ids[update.request_id]] += update.tokens
        report[name] = {"engine": [tokens[i] for i in range(len(LENS))], "reference": reference["tokens"],
                        "lengths": reference["lengths"], "state_spec": spec_list(engine.state.tokens),
                        "cache_spec": spec_list(jax.tree.leaves(engine.state.cache)[0])}  # fmt: skip
    return report


# The worker's parts, each run in a child of its own (tests/parallel/test_sharding.py, test_expert_parallel.py,
# test_slot_sharded_caches.py): separate test files, so the test workers run them side by side.
SECTIONS = {
    "meshes": meshes_report,
    "experts": lambda workdir: {"expert_parallel": expert_parallel_report(), "expert_layers": layer_report()},
    "slots": lambda workdir: {"slots": slot_sharded_report(), "slot_attention": slot_attention_report()},
    "engine": lambda workdir: engine_report(),
}


def run_section(section: str, workdir: pathlib.Path) -> dict:
    """Run SECTIONS[section] in a child process with 8 CPU devices; its report."""
    out = workdir / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.sharded_worker", section, str(out), str(workdir)],
        cwd=ROOT,
        env=cpu_env(8),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


def main(section: str, out_path: str, workdir: str) -> None:
    assert jax.device_count() == 8, f"expected 8 CPU devices (XLA_FLAGS), got {jax.devices()}"
    report = {"devices": jax.device_count(), **SECTIONS[section](workdir)}
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
