"""What a decode pass of a mixture-of-experts model must read: dense weights plus the experts its rows route to.

A pass of R rows, each picking O of E experts, uses on a device holding E_local of them an expected
E_local (1 - (1 - O / E)^R) distinct experts, with routing taken as uniform and the rows independent (real routers
are skewed, which uses fewer). That is the routed floor's expert part; the plain step's floor adds the trunk's
other weights, the final norm, the lm_head and the whole cache (`planning.plain_step_floor`), and an MTP round's adds
a verify pass of B (k + 1) rows through the trunk, k draft passes of B rows through the MTP block (its experts
routed afresh each time) and k reads of the head the drafts come from (its draft vocabulary's rows).

The decode kernel that reads only used experts (kernels/routed_kernel.py) fetches each used expert once (a device
none of whose experts is used skips the call), so `hlo_traffic` counts its custom calls with `expected_experts`.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from mtp_jax.ops.stacked_weights import EXPERT_STACKS


def expected_experts(rows: int, picks: int, total: int, local: int) -> float:
    """Expected distinct experts of `local` (one device's) that `rows` rows of `picks` uniform picks out of `total`
    use."""
    return local * (1.0 - (1.0 - picks / total) ** rows)


def _is_expert(path) -> bool:
    return any(getattr(key, "key", None) in EXPERT_STACKS for key in path)


def _is_mtp(path) -> bool:
    return getattr(path[0], "key", None) == "mtp"


def _shard(leaf) -> tuple[int, ...]:
    return tuple(leaf.sharding.shard_shape(leaf.shape))


def _bytes(leaf) -> int:
    return math.prod(_shard(leaf)) * leaf.dtype.itemsize


def parts(model) -> dict[str, float]:
    """Bytes one device holds of the model, in parts: trunk / mtp dense weights, trunk / mtp expert weights, the
    lm_head as a plain step reads it (the embedding when tied), the MTP layer's own head (`mtp_head`, 0 when it
    drafts through the lm_head), and `local_experts` (E_local). Tables a pass gathers a few rows of (an untied trunk
    embedding, the MTP layer's own, the draft vocabulary's ids) count as nothing."""
    params = nnx.to_pure_dict(nnx.split(model)[1])
    out = dict.fromkeys(("trunk_dense", "mtp_dense", "trunk_experts", "mtp_experts", "lm_head", "mtp_head"), 0.0)
    local = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        top = getattr(path[0], "key", None)
        mtp_part = getattr(path[1], "key", None) if top == "mtp" and len(path) > 1 else None
        if (top == "embed" and model.lm_head is not None) or mtp_part == "embed" or top == "draft_vocab":
            continue  # a pass gathers rows of these (B tokens' embeddings; the draft ids of its picks)
        if top in ("embed", "lm_head"):
            out["lm_head"] += _bytes(leaf)
        elif mtp_part == "head":
            out["mtp_head"] += _bytes(leaf)
        elif _is_expert(path):
            out["mtp_experts" if _is_mtp(path) else "trunk_experts"] += _bytes(leaf)
            local = _shard(leaf)[-3]  # [..., E, D, F] / [..., E, F, D]: the experts one device holds
        else:
            out["mtp_dense" if _is_mtp(path) else "trunk_dense"] += _bytes(leaf)
    out["local_experts"] = local
    return out


def routed_floor_bytes(model, cache_bytes: int, batch: int, num_draft: int, tree: int = 0, tree_width: int = 4) -> int:
    """Bytes per device a pass must read with routed reads: a plain step (num_draft 0: B rows through the trunk)
    or an MTP round (a verify of B (k + 1) rows and its lm_head read, k draft passes of B rows through the MTP block
    and a head; a draft tree of depth k: a verify of B (N + 1) rows, k passes through the MTP block, the j-th of
    B j W rows). A draft pass reads the head it drafts through (the MTP layer's own, else the lm_head), only its
    draft vocabulary's rows where it has one (gathered once before the loop, split as the head is). Dense models: the
    weights and cache the pass reads, no expert part."""
    held = parts(model)
    draft_head = held["mtp_head"] or held["lm_head"]
    if model.draft_vocab is not None:
        draft_head *= model.config.mtp.draft_vocab_size / model.config.vocab_size
    moe = model.config.moe
    local = held["local_experts"]
    data = model.sharding_rules.mesh.shape.get("data", 1)  # a device routes its data shard's rows

    def routed(expert_bytes: float, rows: int) -> float:
        if not local or moe is None:
            return expert_bytes
        used = expected_experts(-(-rows // data), moe.experts_per_token, moe.num_experts, local)
        return expert_bytes * used / local

    rows = batch * ((tree or num_draft) + 1)
    total = held["trunk_dense"] + routed(held["trunk_experts"], rows) + held["lm_head"] + cache_bytes
    for j in range(num_draft):  # the catch-up's pass (B rows), then a chain's steps or a tree's expansions
        draft_rows = batch * (j * tree_width if tree and j else 1)
        total += held["mtp_dense"] + routed(held["mtp_experts"], draft_rows) + draft_head
    return int(total)
