"""Converting DeepSeek-V3 / GLM-4.5 checkpoints in the released key layout: per-expert keys, the MTP layer at
`model.layers.{N}`, its embedding / head copies; every tensor accounted for. Values are checked against the raw
tensors of the file, not through the key table."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mtp_jax
from checkpoints_convert.__main__ import main as convert_main
from mtp_jax.conversion.convert import config_of, convert_params
from mtp_jax.params.open_source import open_source
from tests.support.moe_models import MOE_SHAPE, save_with_mtp_layer

pytestmark = pytest.mark.slow

NUM_LAYERS = 2  # layer 0 dense, layer 1 routed experts, the MTP layer at index 2
EXPERTS = MOE_SHAPE["n_routed_experts"]


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def released(request, tmp_path_factory):
    """(family, HF folder, its tensors); DeepSeek's carries the MTP embedding / head copies, GLM's does not."""
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    save_with_mtp_layer(request.param, folder, NUM_LAYERS, mtp_copies=request.param == "deepseek_v3")
    return request.param, folder, load_file(str(folder / "model.safetensors"))


def test_converts_with_full_accounting(released, tmp_path, capsys):
    family, folder, tensors = released
    assert convert_main([str(folder), str(tmp_path / "out"), "--dtype", "float32"]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "conversion.json").read_text())
    copies = {f"model.layers.{NUM_LAYERS}.{n}.weight" for n in ("embed_tokens", "shared_head.head")}
    assert set(report["tensors_ignored"]) == (copies if family == "deepseek_v3" else set())
    assert report["tensors_used"] + len(report["tensors_ignored"]) == len(tensors)

    model = mtp_jax.load_model(str(tmp_path / "out"), dtype=jnp.float32)
    cfg = model.config
    assert cfg.family == family and cfg.has_mtp and not cfg.mtp.own_embedding and not cfg.mtp.own_head
    dense, moe = model.segments
    mtp = f"model.layers.{NUM_LAYERS}."
    np.testing.assert_array_equal(model.mtp.proj[...], tensors[mtp + "eh_proj.weight"].T)
    np.testing.assert_array_equal(model.mtp.token_norm.scale[...], tensors[mtp + "enorm.weight"])
    np.testing.assert_array_equal(model.mtp.final_norm.scale[...], tensors[mtp + "shared_head.norm.weight"])
    np.testing.assert_array_equal(dense.layers.mlp.down_proj[0], tensors["model.layers.0.mlp.down_proj.weight"].T)
    for stack, prefix in ((moe.layers, "model.layers.1.mlp."), (model.mtp.block.layers, mtp + "mlp.")):
        np.testing.assert_array_equal(stack.mlp.router[0], tensors[prefix + "gate.weight"].T)
        np.testing.assert_array_equal(stack.mlp.router_bias[0], tensors[prefix + "gate.e_score_correction_bias"])
        for e in range(EXPERTS):
            for ours, theirs in (("expert_gate", "gate_proj"), ("expert_up", "up_proj"), ("expert_down", "down_proj")):
                want = tensors[f"{prefix}experts.{e}.{theirs}.weight"].T
                np.testing.assert_array_equal(getattr(stack.mlp, ours)[0, e], want, err_msg=f"{prefix} {e} {ours}")
        np.testing.assert_array_equal(stack.mlp.shared.up_proj[0], tensors[prefix + "shared_experts.up_proj.weight"].T)
    if family == "deepseek_v3":  # kv_b_proj [N * (H + W), R] -> [R, N, H + W]
        kv_b = tensors[mtp + "self_attn.kv_b_proj.weight"]
        want = kv_b.T.reshape(kv_b.shape[1], cfg.num_heads, -1)
        np.testing.assert_array_equal(model.mtp.block.layers.attn.kv_b_proj[0], want)


def test_distinct_mtp_copies_are_the_mtp_layers_own(released, tmp_path):
    """An MTP embedding / head that differs from the trunk's becomes the MTP layer's own (drafts use that head);
    the trunk keeps its own."""
    _, folder, tensors = released
    rng = np.random.default_rng(7)
    mtp = f"model.layers.{NUM_LAYERS}."
    edited = dict(tensors)
    for name, trunk in (
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("shared_head.head.weight", "lm_head.weight"),
    ):
        edited[mtp + name] = (tensors[trunk] + 0.1 * rng.standard_normal(tensors[trunk].shape)).astype(np.float32)
    (tmp_path / "hf").mkdir()
    save_file(edited, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text((folder / "config.json").read_text())
    source = open_source(str(tmp_path / "hf"))
    cfg = config_of(source)
    assert cfg.mtp.own_embedding and cfg.mtp.own_head
    params, plan = convert_params(source, cfg, jnp.float32)
    assert not plan.ignored and len(plan.targets) == len(edited)
    np.testing.assert_array_equal(params[("mtp", "embed")], edited[mtp + "embed_tokens.weight"])
    np.testing.assert_array_equal(params[("mtp", "head")], edited[mtp + "shared_head.head.weight"].T)
    np.testing.assert_array_equal(params[("embed",)], tensors["model.embed_tokens.weight"])
    model = mtp_jax.load_model(str(tmp_path / "hf"), dtype=jnp.float32)
    hidden = rng.standard_normal((1, 2, cfg.hidden_size)).astype(np.float32)
    want = hidden @ edited[mtp + "shared_head.head.weight"].T
    np.testing.assert_allclose(model.draft_logits(hidden), want, rtol=1e-5, atol=1e-5)


def test_deepseek_v32_is_refused_in_one_line(released, tmp_path, capsys):
    family, folder, _ = released
    if family != "deepseek_v3":
        pytest.skip("DeepSeek only")
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v32"}))
    (tmp_path / "hf" / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "deepseek_v32" in err and "indexer" in err
    assert not (tmp_path / "out").exists()
