"""Model shapes without weights: named shapes (`python -m mtp_jax.bench --random-shape NAME`, `python -m mtp_jax.plan
--random-shape NAME`) and `config_from_path`, the shape of a model folder or config file.

The full-size shapes are the released Hugging Face `config.json` files in mtp_jax/data/released_configs/ (sources:
its README), mapped by the converter's own `model_config_from_hf`: a shape is exactly what a user bringing that
config.json gets. The test sizes are written out here; the slices are full shapes cut to a few layers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Callable

from mtp_jax.config.model import ModelConfig, MtpConfig, RopeConfig
from mtp_jax.families.registry import model_config_from_hf, tiny_configs
from mtp_jax.params.converted import read_converted_config
from mtp_jax.params.source import read_json_object
from mtp_jax.params.tree import CONFIG_FILE
from mtp_jax.runtime.errors import ConversionError, UserError

FULL_CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "data" / "released_configs"  # {name}.json, as released
FULL_SHAPES = (
    "deepseek-v3",
    "glm-4.5",
    "glm-4.5-air",
    "mimo-7b",
    "qwen3-next-80b-a3b",
    "qwen3.5-397b-a17b",
    "qwen3.6-27b",
    "qwen3.6-35b-a3b",
)


def _read_json(path: str) -> dict:
    try:
        return read_json_object(path)
    except ConversionError as e:  # names the file
        raise UserError(str(e)) from None


def _hf_config(path: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json; EOS ids from a generation_config.json beside it when the config
    has none, as conversion reads them (mtp_jax/params/source.py)."""
    hf = _read_json(path)
    generation = os.path.join(os.path.dirname(path), "generation_config.json")
    if "eos_token_id" not in hf and os.path.isfile(generation):
        hf["eos_token_id"] = _read_json(generation).get("eos_token_id")
    try:
        return model_config_from_hf(hf)
    except ConversionError as e:  # a missing, mistyped or unsupported field, by name
        raise UserError(f"{path}: {e}") from None


def _converted_config(path: str) -> ModelConfig:
    try:
        return read_converted_config(path)
    except ConversionError as e:  # names the file and the field
        raise UserError(str(e)) from None


def config_from_path(path: str) -> ModelConfig:
    """The ModelConfig at `path`, no weights read: a converted mtp_jax folder (its mtp_jax_config.json), a Hugging
    Face folder (its config.json: weights optional), or either JSON file itself. A config that announces an MTP
    layer gives a shape with one, also where a checkpoint strips the layer (conversion then drops it)."""
    if os.path.isdir(path):
        converted, hf = os.path.join(path, CONFIG_FILE), os.path.join(path, "config.json")
        if os.path.isfile(converted):
            return _converted_config(converted)
        if os.path.isfile(hf):
            return _hf_config(hf)
        raise UserError(f"{path}: no config.json or {CONFIG_FILE} (not a model folder)")
    if os.path.isfile(path):
        return _converted_config(path) if os.path.basename(path) == CONFIG_FILE else _hf_config(path)
    raise UserError(f"{path}: no such file or folder")


def full_shape(name: str) -> ModelConfig:
    """A released model's shape: data/released_configs/{name}.json through the converter's config mapping."""
    return config_from_path(str(FULL_CONFIGS / f"{name}.json"))


def tiny_family_shape(name: str) -> ModelConfig:
    """A family's test size (`Family.tiny_configs`) through its config mapping."""
    return model_config_from_hf(tiny_configs()[name])


def tiny() -> ModelConfig:
    """Test size (the llama family's `llama-with-mtp-head`): 2 layers, hidden 64, vocab 256, a DeepSeek-layout head."""
    return tiny_family_shape("llama-with-mtp-head")


def smollm2_135m() -> ModelConfig:
    """The default model's trunk (SmolLM2-135M-Instruct) plus one DeepSeek-layout MTP layer, as train_head adds."""
    return ModelConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0),
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        eos_token_ids=(2,),
        bos_token_id=1,
        mtp=MtpConfig(layout="deepseek"),
    )


def deepseek_v3_tiny() -> ModelConfig:
    """Test size (the deepseek_v3 family's): 3 layers (1 dense, 2 with 16 routed experts, top-4 of 2 groups of the
    4), MLA with query LoRA, yarn rotary, a DeepSeek MTP layer with experts."""
    return tiny_family_shape("deepseek_v3")


def deepseek_v3_slice() -> ModelConfig:
    """DeepSeek-V3 at real width, 2 layers deep (the first dense, the second with all 256 routed experts) plus its
    MTP layer (256 experts too): about 25B parameters, 50 GB in bfloat16 — for an 80 GB accelerator."""
    full = full_shape("deepseek-v3")
    return full.replace(num_layers=2, moe=dataclasses.replace(full.moe, first_dense_layers=1))


def qwen3_5_tiny() -> ModelConfig:
    """The qwen3_5 family's test size (4 layers, 2 groups of 2) at 8 layers, 2 groups of (3 DeltaNet, 1 gated
    attention), hidden 64, vocab 256, its MTP layer."""
    layer_types = ("linear_attention",) * 3 + ("full_attention",)
    return tiny_family_shape("qwen3_5").replace(num_layers=8, layer_types=layer_types * 2)


def qwen3_6_27b_slice() -> ModelConfig:
    """Qwen3.6-27B at real width, 8 of its 64 layers (2 groups of 3 DeltaNet + 1 gated attention) plus its MTP
    layer: about 6.0B parameters, 12 GB in bfloat16."""
    full = full_shape("qwen3.6-27b")
    return full.replace(num_layers=8, layer_types=full.layer_types[:8])


SHAPES: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "smollm2-135m": smollm2_135m,
    "deepseek-v3-tiny": deepseek_v3_tiny,
    "deepseek-v3-slice": deepseek_v3_slice,
    "qwen3.5-tiny": qwen3_5_tiny,
    "qwen3.6-27b-slice": qwen3_6_27b_slice,
    **{name: functools.partial(full_shape, name) for name in FULL_SHAPES},
}


def shape_names() -> list[str]:
    return sorted(SHAPES)


def shape(name: str) -> ModelConfig:
    """The named shape; an unknown name is a one-line error listing the known ones."""
    if name not in SHAPES:
        raise UserError(f"unknown shape {name!r}; known: {', '.join(shape_names())}")
    return SHAPES[name]()
