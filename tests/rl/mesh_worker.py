"""Runs in a child process with 4 CPU devices (tests/rl/test_tunix_mesh.py starts it): `MtpRollout` on a tunix mesh
(fsdp=2, tp=2) against the same engine on one device, with the policy laid out on the mesh as tunix's RLCluster
lays it out. Writes what it saw as JSON. Usage: python -m tests.rl.mesh_worker OUT.json"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from flax import nnx

from mtp_jax.rl.tunix_rollout import MtpRollout
from tests.rl.test_tunix_rollout import PROMPTS, as_tunix_syncs_weights, moved, rollout_config
from tests.rl.tunix_support import CharTokenizer, predictable_head, tiny_tunix_model


def on_mesh(model, mesh):
    """tunix `model` with its parameters in their declared shardings on `mesh` (as RLCluster places the actor)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    return model


def rollouts(model, mesh, trainer) -> tuple[list, list, MtpRollout]:
    engine = MtpRollout(model, CharTokenizer(), mesh, rollout_config(0.0), head=predictable_head(model), num_draft=2)
    before = [t.tolist() for t in engine.generate(PROMPTS, rollout_config(0.0)).tokens]
    with as_tunix_syncs_weights():
        engine.update_params(nnx.state(trainer, nnx.Param), (nnx.Param,))
    after = [t.tolist() for t in engine.generate(PROMPTS, rollout_config(0.0)).tokens]
    return before, after, engine


def main(out: str) -> None:
    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    policy = tiny_tunix_model("llama3", seed=3, context_scale=0.3, logit_scale=32.0)
    trainer = moved(policy)
    alone = rollouts(policy, None, trainer)
    sharded = rollouts(on_mesh(tiny_tunix_model("llama3", seed=3, context_scale=0.3, logit_scale=32.0), mesh), mesh,
                       on_mesh(moved(policy), mesh))  # fmt: skip
    model = sharded[2].decode_model
    report = {
        "devices": len(jax.devices()),
        "one_device": alone[:2],
        "mesh": sharded[:2],
        "embed_devices": len(model.embed[...].sharding.device_set),
        "q_proj_shard": list(model.segments[0].layers.attn.q_proj[...].addressable_shards[0].data.shape),
        "q_proj_shape": list(model.segments[0].layers.attn.q_proj[...].shape),
        "slots": sharded[2]._slots,
        "accepted": sharded[2].last_stats["accepted"],
    }
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main(sys.argv[1])
