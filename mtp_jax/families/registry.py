"""The registry of checkpoint families: importing a family module registers it (mtp_jax/families/base.py).
Adding a family = its module in mtp_jax/families/ plus its name on the import line below (docs/adding-a-family.md).

`model_config_from_hf` maps any supported `config.json` through its family; `family_of` finds a family by
`model_type`.
"""

from __future__ import annotations

from mtp_jax.config.model import ModelConfig
from mtp_jax.families import (  # noqa: F401 (registers)
    deepseek_v3,
    glm4_moe,
    llama,
    mimo,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen_hybrid,
)
from mtp_jax.families.base import REGISTERED, Family
from mtp_jax.families.common import check_field_types
from mtp_jax.runtime.errors import ConversionError

FAMILIES: tuple[Family, ...] = tuple(REGISTERED)
SUPPORTED_MODEL_TYPES = tuple(t for family in FAMILIES for t in family.model_types)
REFUSED_MODEL_TYPES = {
    "deepseek_v32": "deepseek_v32 (DeepSeek-V3.2) is not supported yet: its sparse attention indexer is not "
    "implemented (DeepSeek-V3, R1 and V3.1 are: model_type deepseek_v3)",
}


def family_of(model_type: str) -> Family:
    """The family whose config.json files say `model_type`; an unknown or refused one is a ConversionError."""
    if model_type in REFUSED_MODEL_TYPES:
        raise ConversionError(REFUSED_MODEL_TYPES[model_type])
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ConversionError(f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config dict of a supported family; a missing or bad field is refused
    with one line naming it (the caller, which knows the file, puts its path before)."""
    if not isinstance(hf, dict):
        raise ConversionError(f"expected a JSON object, got {type(hf).__name__}")
    check_field_types(hf)
    family = family_of(hf.get("model_type"))
    try:
        return family.model_config(hf)
    except KeyError as e:
        raise ConversionError(f"{e.args[0]} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(str(e)) from None


def tiny_configs() -> dict[str, dict]:
    """Every family's test-size config.json dicts, by name."""
    return {name: config for family in FAMILIES for name, config in family.tiny_configs.items()}
