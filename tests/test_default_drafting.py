"""The default drafting (mtp_jax/default_drafting.py): on a CPU, adaptive from measured round costs where a draft
can pay, plain decoding where none can; round costs timed once per key and read back after."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from mtp_jax import default_drafting, shapes
from mtp_jax.config import DecodeConfig
from mtp_jax.models.causal_lm import CausalLM

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's default drafting")


@pytest.fixture(scope="module")
def model():
    return CausalLM(shapes.SHAPES["tiny"](), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "costs, adaptive",
    [((1.0, 1.2, 1.3), True), ((1.5, 2.1, 3.2), False)],  # (j + 1) / c_j: 0.95 and 0.94 against resting's ~0.97
    ids=["a-draft-can-pay", "none-can"],
)
def test_adaptive_where_a_draft_can_pay_plain_where_none_can(model, monkeypatch, costs, adaptive):
    monkeypatch.setattr(default_drafting, "cpu_round_costs", lambda *a: (costs, False))
    drafting = default_drafting.choose(model, batch_size=1)
    assert (drafting.adaptive, drafting.num_draft) == ((True, 2) if adaptive else (False, 0))
    cfg = default_drafting.apply(DecodeConfig(num_draft=3), drafting)
    assert cfg.round_costs == (costs if adaptive else None)
    assert drafting.reason.startswith("adaptive drafting, up to 2" if adaptive else "plain decoding")


def test_round_costs_are_timed_once_per_key(model, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    costs, measured_now = default_drafting.cpu_round_costs(model, 1, 1, False)
    assert measured_now and len(costs) == 2 and costs[0] >= 1.0 and costs[1] >= 1.0
    assert default_drafting.cpu_round_costs(model, 1, 1, False) == (costs, False)
    assert default_drafting.cpu_round_costs(model, 2, 1, False)[1]  # another batch size: timed again
    assert default_drafting.costs_path().is_file()
