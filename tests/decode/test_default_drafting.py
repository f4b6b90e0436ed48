"""The default drafting (mtp_jax/decode/default_drafting.py): on a CPU, the k whose measured round cost and acceptance
give the most tokens per unit of time where it beats plain decoding, plain decoding where none does; measurements
taken once per key and read back after."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode import default_drafting
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.plan import shapes
from mtp_jax.runtime.cache_folder import CACHE_ENV

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's default drafting")
IDS, LENS = np.tile(np.arange(1, 17, dtype=np.int32), (1, 1)), np.asarray([16], np.int32)


@pytest.fixture(scope="module")
def model():
    return CausalLM(shapes.SHAPES["tiny"](), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "costs, accepted, chosen",
    [  # 96 drafts judged at each depth; acceptance with the prior's 32 at 0.35: (a + 11.2) / 128
        ((1.0, 1.24, 1.67), (64, 69), 1),  # 0.59, 0.63: tokens per plain step 1.28 (k = 1) against 1.17 (k = 2)
        ((1.0, 1.1, 1.2), (80, 86), 2),  # 0.71, 0.76: 1.56 against 1.87
        ((1.0, 1.5, 2.0), (29, 29), 0),  # 0.31, 0.31: 0.87 and 0.71, plain decoding
        ((1.0, 1.5, 2.0), (14, 14), 0),  # 14 of 16 on a lucky prompt: (14 + 11.2) / 48 = 0.53, 1.02x: not enough
    ],
)
def test_the_k_with_the_most_tokens_per_unit_of_time(model, monkeypatch, costs, accepted, chosen):
    judged = [16, 16] if accepted == (14, 14) else [96, 96]
    found = {"costs": list(costs), "judged": judged, "accepted": list(accepted)}
    monkeypatch.setattr(default_drafting, "measured", lambda *a: (found, "measured earlier"))
    drafting = default_drafting.choose(model, IDS, LENS)
    assert (drafting.num_draft, drafting.adaptive) == (chosen, False)
    assert drafting.reason.startswith(f"{chosen} draft(s) a round" if chosen else "plain decoding")
    cfg = default_drafting.apply(DecodeConfig(num_draft=3), drafting)
    assert cfg.num_draft == chosen and cfg.round_costs is None


@pytest.mark.slow
def test_measured_once_per_key(model, monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    found, when = default_drafting.measured(model, IDS, LENS, 1, False, "fixed")
    assert when.startswith("measured now") and len(found["costs"]) == 2 and len(found["judged"]) == 1
    assert found["costs"][0] == 1.0 and found["costs"][1] >= 1.0 and 0 <= found["accepted"][0] <= found["judged"][0]
    tokens = default_drafting.TIMED_TOKENS  # one row, a draft judged every round, one or two tokens a round
    assert tokens // 2 <= found["judged"][0] <= tokens
    assert default_drafting.measured(model, IDS, LENS, 1, False, "fixed") == (found, "measured here earlier")
    adaptive, when = default_drafting.measured(model, IDS, LENS, 1, False, "adaptive")  # another key
    assert when.startswith("measured now") and len(adaptive["costs"]) == 2
    with_tree, when = default_drafting.measured(model, IDS, LENS, 1, False, "adaptive", (2, 2))  # another key
    assert when.startswith("measured now") and len(with_tree["costs"]) == 3  # probe, one draft, the tree
    assert default_drafting.costs_path().is_file()


def test_a_retrained_head_or_trunk_of_the_same_shape_is_measured_again(model):
    """What is kept depends on the model's values: a head or trunk of the same shape with other values gets its own
    key."""
    key = lambda m: default_drafting._costs_key(m, 1, 2, False, "fixed")

    def copy():
        other = CausalLM(model.config, rngs=nnx.Rngs(0))
        nnx.update(other, nnx.state(model))
        return other

    assert key(copy()) == key(model)
    retrained, finetuned = copy(), copy()
    retrained.mtp.proj[...] = retrained.mtp.proj[...] + 1e-3
    finetuned.final_norm.scale[...] = finetuned.final_norm.scale[...] * 2
    assert len({key(model), key(retrained), key(finetuned)}) == 3


def test_adaptive_with_a_tree_gets_the_trees_cost_last(model, monkeypatch):
    found = {"costs": [1.0, 1.3, 1.7, 2.1, 3.4]}
    monkeypatch.setattr(default_drafting, "measured", lambda *a: (found, "measured earlier"))
    drafting = default_drafting.choose(model, IDS, LENS, max_draft=3, adaptive=True, tree=(8, 2))
    assert drafting.round_costs == tuple(found["costs"]) and "a tree of 8 nodes 3.40" in drafting.reason
    cfg = default_drafting.apply(DecodeConfig(num_draft=3, tree=8, tree_width=2), drafting)
    assert cfg.adaptive and cfg.tree == 8 and cfg.round_costs == tuple(found["costs"])


@pytest.mark.slow
def test_an_accelerator_times_rounds_of_a_mixture_of_experts_only(model, monkeypatch):
    """On an accelerator a dense model drafts DEFAULT_DRAFTS["other"] a round untimed (a verify pass costs about a
    plain step there); a mixture of experts has its rounds timed (a verify pass routes to more experts), and a
    round costing too much for its acceptance gets plain decoding."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    asked = []

    def measured(*args):
        asked.append(args[3])
        return {"costs": [1.0, 1.9, 2.8, 3.7], "judged": [96] * 3, "accepted": [64, 60, 58]}, "measured earlier"

    monkeypatch.setattr(default_drafting, "measured", measured)
    dense = default_drafting.choose(model, IDS, LENS)
    assert dense.num_draft == default_drafting.DEFAULT_DRAFTS["other"] and asked == []
    moe = CausalLM(shapes.SHAPES["deepseek-v3-tiny"](), rngs=nnx.Rngs(0))
    chosen = default_drafting.choose(moe, IDS, LENS)
    assert asked == [default_drafting.DEFAULT_DRAFTS["other"]]
    assert chosen.num_draft == 0 and "GPU (a mixture of experts" in chosen.reason
