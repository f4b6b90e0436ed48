"""The full-size shapes (mtp_jax/data/released_configs through the converter's mapping) against the models'
published parameter counts, and `config_from_path`.

Each shape's parameters are counted from the abstract model (shapes only, nothing allocated) and compared with a
count written here from the config.json fields by the Hugging Face modules' definitions: equal to the last parameter,
so a tensor we lack or add shows. Totals are then held to the published figures within 1%, and the parameters one
token reads (from the same formula) to the published "A" figures within 5%. No count includes a vision tower (the
Qwen3.5 / 3.6 releases are VLMs; only their text path is built).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from mtp_jax.families.registry import model_config_from_hf, tiny_configs
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.params.source import SafetensorsFolderSource
from mtp_jax.params.tree import CONFIG_FILE
from mtp_jax.plan import shapes
from mtp_jax.runtime.errors import UserError

FULL = shapes.FULL_CONFIGS


def released(name: str) -> dict:
    return json.loads((FULL / f"{name}.json").read_text())


@dataclasses.dataclass(frozen=True)
class Counts:
    """Parameters by the config's formula. `expert`: one routed expert's; `moe_layers`: trunk layers with experts."""

    trunk: int  # embedding, layers, final norm, output head
    mtp: int  # the MTP layer without the embedding and head it shares with the trunk
    embed: int
    head: int
    expert: int = 0
    experts: int = 0
    picked: int = 0
    moe_layers: int = 0


def formula_counts(hf: dict) -> Counts:
    """The parameter count of a released config.json, by the transformers modules of its family."""
    family, t = hf["model_type"], hf.get("text_config", hf)
    d, v = t["hidden_size"], t["vocab_size"]
    embed = v * d
    head = 0 if hf.get("tie_word_embeddings", t.get("tie_word_embeddings", False)) else v * d
    h, kv = t["num_attention_heads"], t.get("num_key_value_heads", t["num_attention_heads"])
    if family == "mimo":  # Qwen2 layers (q/k/v bias); MTP: token and hidden norms, input_proj, a layer, final norm
        hd = d // h
        layer = d * h * hd + 2 * d * kv * hd + h * hd * d + (h + 2 * kv) * hd + 3 * d * t["intermediate_size"] + 2 * d
        n = t["num_hidden_layers"]
        return Counts(embed + head + d + n * layer, 3 * d + 2 * d * d + layer, embed, head)
    if family in ("deepseek_v3", "glm4_moe"):
        if family == "deepseek_v3":  # MLA: q_a (+ norm), q_b, kv_a (+ norm), kv_b, o
            q, c, nope, rope, vd = (t[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                   "qk_rope_head_dim", "v_head_dim"))  # fmt: skip
            attn = d * q + q + q * h * (nope + rope) + d * (c + rope) + c + c * h * (nope + vd) + h * vd * d
        else:  # GQA with q/k/v bias, optional per-head q/k norm
            hd = t["head_dim"]
            attn = d * h * hd + 2 * d * kv * hd + h * hd * d + (h + 2 * kv) * hd + (2 * hd if t["use_qk_norm"] else 0)
        e, expert = t["n_routed_experts"], 3 * d * t["moe_intermediate_size"]
        moe = e * d + e + e * expert + t["n_shared_experts"] * expert  # router, selection bias, experts, shared
        dense, n = t["first_k_dense_replace"], t["num_hidden_layers"]
        dense_layer, moe_layer = attn + 3 * d * t["intermediate_size"] + 2 * d, attn + moe + 2 * d
        trunk = embed + head + d + dense * dense_layer + (n - dense) * moe_layer
        mtp = 3 * d + 2 * d * d + moe_layer  # enorm, hnorm, shared_head.norm, eh_proj, an expert layer
        return Counts(trunk, mtp, embed, head, expert, e, t["num_experts_per_tok"], n - dense)
    # Qwen3-Next / 3.5 / 3.6: gated attention (q_proj doubled for the gate, q/k norm) or gated DeltaNet layers
    hd = t["head_dim"]
    gated = 2 * d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd
    kh, vh, kd, vd = (t[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    conv = 2 * kh * kd + vh * vd  # q, k, v channels
    # in_proj_qkv, in_proj_z, in_proj_b and _a, conv1d, dt_bias and A_log, the gated norm, out_proj
    delta = d * conv + d * vh * vd + 2 * d * vh + conv * t["linear_conv_kernel_dim"] + 2 * vh + vd + vh * vd * d
    e = t.get("num_experts", 0)
    expert = 3 * d * t["moe_intermediate_size"] if e else 0
    # router, experts, shared expert and its gate; or a dense SwiGLU
    mlp = e * d + e * expert + 3 * d * t["shared_expert_intermediate_size"] + d if e else 3 * d * t["intermediate_size"]
    layers = t.get("layer_types") or [
        "full_attention" if (i + 1) % t["full_attention_interval"] == 0 else "linear_attention"
        for i in range(t["num_hidden_layers"])
    ]
    trunk = embed + head + d + sum((gated if kind == "full_attention" else delta) + mlp + 2 * d for kind in layers)
    mtp = 2 * d * d + 3 * d + gated + mlp + 2 * d  # fc, its two input norms and final norm, a gated attention layer
    return Counts(trunk, mtp, embed, head, expert, e, t.get("num_experts_per_tok", 0), len(layers) if e else 0)


@functools.cache
def abstract_counts(name: str) -> tuple[int, int]:
    """(trunk, MTP layer) parameters of the abstract model of a named shape, in bfloat16."""
    model = nnx.eval_shape(lambda: CausalLM(shapes.SHAPES[name](), dtype=jnp.bfloat16))
    total = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    mtp = sum(p.size for p in jax.tree.leaves(nnx.state(model.mtp, nnx.Param)))
    return total - mtp, mtp


def test_every_released_config_is_a_named_shape():
    assert sorted(p.stem for p in FULL.glob("*.json")) == sorted(shapes.FULL_SHAPES)
    assert set(shapes.FULL_SHAPES) < set(shapes.shape_names())
    old = ("tiny", "smollm2-135m", "deepseek-v3-tiny", "deepseek-v3-slice", "qwen3.5-tiny", "qwen3.6-27b-slice")
    assert set(old) < set(shapes.shape_names())


@pytest.mark.parametrize("name", shapes.FULL_SHAPES)
def test_abstract_model_has_the_released_checkpoints_parameters(name):
    """Every parameter of the family's transformers model, trunk and MTP layer, and no other."""
    counts = formula_counts(released(name))
    assert abstract_counts(name) == (counts.trunk, counts.mtp)


# (shape, what the published figure counts, the figure, where it is stated)
PUBLISHED_TOTALS = [
    ("deepseek-v3", "trunk", 671e9, "DeepSeek-V3 README_WEIGHTS: main model 671B"),
    # 685B = 671B + the 14B MTP module as stored: 11.5B of its own plus copies of the embedding and the output head,
    # which it shares with the trunk here (counted once).
    ("deepseek-v3", "trunk + MTP + MTP's copies", 685e9, "Hugging Face card: 685B"),
    ("glm-4.5", "trunk", 355e9, "GLM-4.5 README: 355B total, without the MTP layer as Air's 106B shows"),
    ("glm-4.5-air", "trunk", 106e9, "GLM-4.5 README: GLM-4.5-Air 106B total"),
    ("qwen3-next-80b-a3b", "trunk", 80e9, "model card: 80B in total"),
    ("qwen3.5-397b-a17b", "trunk", 397e9, "model card: 397B"),
    ("qwen3.6-35b-a3b", "trunk", 35e9, "model card: 35B (34.66B here; its 0.45B vision tower not built)"),
    ("qwen3.6-27b", "trunk", 27e9, "model card: 27B"),
    ("mimo-7b", "trunk + MTP", 7.8e9, "MiMo-7B: 7.8B with its MTP layer"),
]


@pytest.mark.parametrize(
    ("name", "part", "published", "source"), [pytest.param(*row, id=f"{row[0]}, {row[1]}") for row in PUBLISHED_TOTALS]
)
def test_total_parameters_match_the_published_figure(name, part, published, source):
    trunk, mtp = abstract_counts(name)
    counts = formula_counts(released(name))
    counted = {
        "trunk": trunk,
        "trunk + MTP": trunk + mtp,
        "trunk + MTP + MTP's copies": trunk + mtp + counts.embed + counts.head,
    }[part]
    assert abs(counted / published - 1) < 0.01, (counted, source)


# (shape, the published activated parameters, what the vendor's figure leaves out, where it is stated). One token
# reads the trunk's every parameter except the routed experts it does not pick; vendors differ on the embedding
# table (a row lookup) and the output head.
PUBLISHED_ACTIVE = [
    ("deepseek-v3", 37e9, "embedding", "DeepSeek: 37B; 36.6B 'including 0.9B for the output head'"),
    ("glm-4.5", 32e9, "embedding and head", "GLM-4.5 README: 32B active"),
    ("glm-4.5-air", 12e9, "embedding and head", "GLM-4.5 README: 12B active"),
    ("qwen3.5-397b-a17b", 17e9, "embedding", "A17B"),
    ("qwen3.6-35b-a3b", 3e9, "embedding", "A3B"),
    # Qwen3-Next: 3.25B without embedding and head (3.56B with the head): only the name "A3B" states a figure, and it
    # is rounded further than Qwen3.6-35B-A3B's (2.95B); held to the nearest billion below.
    ("qwen3-next-80b-a3b", 3e9, "embedding and head", "A3B, rounded to the billion"),
]


@pytest.mark.parametrize(("name", "published", "left_out", "source"), PUBLISHED_ACTIVE)
def test_active_parameters_match_the_published_figure(name, published, left_out, source):
    c = formula_counts(released(name))
    active = c.trunk - (c.experts - c.picked) * c.expert * c.moe_layers
    active -= {"embedding": c.embed, "embedding and head": c.embed + c.head}[left_out]
    if "rounded to the billion" in source:
        assert round(active / 1e9) == published / 1e9, (active, source)
    else:
        assert abs(active / published - 1) < 0.05, (active, source)


@pytest.mark.parametrize(
    ("name", "full", "layers", "billions"), [("deepseek-v3-slice", "deepseek-v3", 2, 25.6),
                                             ("qwen3.6-27b-slice", "qwen3.6-27b", 8, 6.0)]
)  # fmt: skip
def test_slices_have_every_kind_of_layer_at_full_width(name, full, layers, billions):
    cut, whole = shapes.shape(name), shapes.shape(full)
    assert cut.num_layers == layers and cut.hidden_size == whole.hidden_size
    kinds = {cut.layer_kind(i) for i in range(layers + 1)}  # + its MTP layer
    assert kinds == {whole.layer_kind(i) for i in range(whole.num_layers + 1)}
    assert round(sum(abstract_counts(name)) / 1e9, 1) == billions  # their docstrings' sizes


@pytest.mark.parametrize("name", shapes.FULL_SHAPES)
def test_a_folder_holding_only_config_json_gives_the_named_shape(name, tmp_path):
    (tmp_path / "config.json").write_text((FULL / f"{name}.json").read_text())
    expected = model_config_from_hf(released(name))
    assert shapes.config_from_path(str(tmp_path)) == expected == shapes.shape(name)
    assert shapes.config_from_path(str(tmp_path / "config.json")) == expected


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3.6-35b-a3b"])
def test_a_converted_folder_gives_its_own_config(name, tmp_path):
    cfg = shapes.shape(name)
    (tmp_path / CONFIG_FILE).write_text(cfg.to_json())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not read"}))
    assert shapes.config_from_path(str(tmp_path)) == cfg
    assert shapes.config_from_path(str(tmp_path / CONFIG_FILE)) == cfg


def test_eos_from_generation_config_as_conversion_reads_it(tmp_path):
    hf = dict(tiny_configs()["llama"])
    hf.pop("eos_token_id")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert shapes.config_from_path(str(tmp_path)).eos_token_ids == (7, 9)
    save_file({"unused": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    converter_reads = SafetensorsFolderSource(str(tmp_path)).hf_config
    assert shapes.config_from_path(str(tmp_path)) == model_config_from_hf(converter_reads)


def _write(folder: pathlib.Path, name: str, text: str) -> str:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    return str(folder)


NO_LORA_RANK = {k: v for k, v in released("deepseek-v3").items() if k != "kv_lora_rank"}
SIGMOID_GATE = {
    **released("qwen3.6-27b"),
    "text_config": {**released("qwen3.6-27b")["text_config"], "output_gate_type": "sigmoid"},
}
SLIDING = {**released("qwen3-next-80b-a3b"), "use_sliding_window": True}
BAD_PATHS = {
    "no such file or folder": lambda tmp: str(tmp / "missing"),
    "no config.json or mtp_jax_config.json": lambda tmp: _write(tmp / "weights_only", "model.safetensors", ""),
    "invalid JSON": lambda tmp: _write(tmp / "bad", "config.json", '{"model_type": "llama",'),
    "expected a JSON object": lambda tmp: _write(tmp / "list", "config.json", "[1, 2]"),
    "unknown model_type 'gpt2'": lambda tmp: _write(tmp / "gpt2", "config.json", '{"model_type": "gpt2"}'),
    "kv_lora_rank": lambda tmp: _write(tmp / "part", "config.json", json.dumps(NO_LORA_RANK)),
    "output_gate_type 'sigmoid'": lambda tmp: _write(tmp / "gate", "config.json", json.dumps(SIGMOID_GATE)),
    "use_sliding_window: true": lambda tmp: _write(tmp / "window", "config.json", json.dumps(SLIDING)),
    "not an mtp_jax model config": lambda tmp: _write(tmp / "converted", CONFIG_FILE, '{"family": "llama"}'),
}


@pytest.mark.parametrize("message", BAD_PATHS)
def test_an_unusable_path_is_one_line_naming_it(message, tmp_path):
    path = BAD_PATHS[message](tmp_path)
    with pytest.raises(UserError) as error:
        shapes.config_from_path(path)
    text = str(error.value)
    assert message in text and path in text and "\n" not in text, text


def test_an_unknown_shape_name_lists_the_known_ones():
    with pytest.raises(UserError) as error:
        shapes.shape("deepseek-v4")
    text = str(error.value)
    assert "'deepseek-v4'" in text and "\n" not in text
    assert all(name in text for name in shapes.shape_names())
