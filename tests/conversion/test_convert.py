"""`python -m checkpoints_convert`: round trips, and one-line errors that name the culprit and leave no DST."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import mtp_jax
from checkpoints_convert.__main__ import main as convert_main
from mtp_jax.conversion.export import hf_tensors, save_hf_folder
from tests.support.tiny_models import tiny_config


def tiny_model(family="llama", layout="deepseek", seed=0) -> mtp_jax.CausalLM:
    cfg = tiny_config(layout, vocab=64, eos=(1,)).replace(family=family, qkv_bias=family in ("qwen2", "mimo"))
    return mtp_jax.CausalLM(cfg, rngs=nnx.Rngs(seed))


def run_convert(capsys, *args) -> tuple[int, str]:
    code = convert_main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_same_params(a: mtp_jax.CausalLM, b: mtp_jax.CausalLM):
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), [("llama", "deepseek"), ("qwen2", "deepseek"), ("mimo", "mimo")])
def test_round_trip_through_converted_folder(tmp_path, capsys, family, layout):
    model = tiny_model(family, layout)
    save_hf_folder(model, tmp_path / "hf")
    code, _ = run_convert(capsys, tmp_path / "hf", tmp_path / "out", "--dtype", "float32")
    assert code == 0
    assert_same_params(model, mtp_jax.load_model(str(tmp_path / "out"), dtype=jnp.float32))
    report = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert report["tensors_used"] == len(hf_tensors(model))


def test_sharded_index_round_trip(tmp_path, capsys):
    model = tiny_model()
    tensors = hf_tensors(model)
    save_hf_folder(model, tmp_path / "single")
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    names = sorted(tensors)
    shards = [names[0::3], names[1::3], names[2::3]]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in shard}, str(folder / fname))
        weight_map.update(dict.fromkeys(shard, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    code, err = run_convert(capsys, folder, tmp_path / "out", "--dtype", "float32")
    assert code == 0, err
    assert_same_params(model, mtp_jax.load_model(str(tmp_path / "out"), dtype=jnp.float32))
    assert_same_params(model, mtp_jax.load_model(str(folder), dtype=jnp.float32))


def test_bfloat16_conversion_rounds_each_tensor(tmp_path, capsys):
    model = tiny_model()
    save_hf_folder(model, tmp_path / "hf")
    assert run_convert(capsys, tmp_path / "hf", tmp_path / "out", "--dtype", "bfloat16")[0] == 0
    loaded = mtp_jax.load_model(str(tmp_path / "out"), dtype=jnp.bfloat16)
    assert loaded.embed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded.embed[...]), np.asarray(model.embed[...].astype(jnp.bfloat16)))


def _edit_checkpoint(folder, edit):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


CORRUPTIONS = {
    "unexpected": (
        lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}),
        ["unexpected tensors", "model.layers.0.self_attn.extra.weight"],
    ),
    "missing": (
        lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        ["missing tensors", "model.layers.1.mlp.up_proj.weight"],
    ),
    "missing_mtp": (
        lambda t: t.pop("model.layers.2.eh_proj.weight"),
        ["missing tensors", "model.layers.2.eh_proj.weight"],
    ),
    "wrong_shape": (
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}),
        ["shape mismatch", "model.layers.0.self_attn.k_proj.weight", "(8, 32)", "(16, 32)"],
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_bad_checkpoint_gives_one_line_and_no_output(tmp_path, capsys, kind):
    edit, expected = CORRUPTIONS[kind]
    save_hf_folder(tiny_model(), tmp_path / "hf")
    _edit_checkpoint(tmp_path / "hf", edit)
    code, err = run_convert(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    for fragment in expected:
        assert fragment in err
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no DST, no partial folder


def test_truncated_safetensors(tmp_path, capsys):
    save_hf_folder(tiny_model(), tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, err = run_convert(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1 and "truncated" in err and "model.safetensors" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_unknown_model_type_lists_supported(tmp_path, capsys):
    save_hf_folder(tiny_model(), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["model_type"] = "falcon"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code, err = run_convert(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1
    assert "falcon" in err and "llama" in err and "qwen3" in err and "mimo" in err
    assert not (tmp_path / "out").exists()


def test_unhandled_config_field_is_refused(tmp_path, capsys):
    save_hf_folder(tiny_model(), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["attn_logit_softcapping"] = 50.0
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code, err = run_convert(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1 and "attn_logit_softcapping" in err


@pytest.mark.slow
def test_existing_destination_needs_overwrite(tmp_path, capsys):
    save_hf_folder(tiny_model(), tmp_path / "hf")
    (tmp_path / "out").mkdir()
    code, err = run_convert(capsys, tmp_path / "hf", tmp_path / "out")
    assert code == 1 and "--overwrite" in err
    assert run_convert(capsys, tmp_path / "hf", tmp_path / "out", "--overwrite")[0] == 0
