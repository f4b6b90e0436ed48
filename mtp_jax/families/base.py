"""`Family`: everything the project knows about one checkpoint family, in one value, and the registry of them.

A family module (mtp_jax/families/<name>.py) builds one `Family` and registers it (`register`); the registry module
(mtp_jax/families/registry.py) imports every family module. docs/adding-a-family.md walks through adding one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mtp_jax.config.model import ModelConfig
from mtp_jax.families.tables import LayerEntry, standard_layer_table


def model_prefix(cfg: ModelConfig) -> str:
    return "model."


@dataclasses.dataclass(frozen=True)
class Family:
    """One checkpoint family.

    model_types: the `model_type` values of its `config.json` files (wrappers included).
    model_config: config.json dict -> ModelConfig; refuses, with one line naming the field, what it does not handle.
    tiny_configs: name -> a config.json dict at test size (tests/families/test_configs.py maps and decodes each).
    layer_table: (cfg, the checkpoint stores the experts fused) -> one decoder layer's key table.
    trunk_prefix: cfg -> the trunk's module prefix in tensor names (`model.`; a VLM wrapper's is deeper).
    ignored_prefixes: tensor-name prefixes this model never reads (a vision tower), with the reason.
    export_config: (cfg, the config.json fields every family shares) -> this family's config.json, when writing a
      checkpoint of it (mtp_jax/conversion/export.py); None: writing this family's checkpoints is refused.
    published_acceptance: (per-position acceptance of the family's own MTP layer, where it was published), or None.
    """

    model_types: tuple[str, ...]
    model_config: Callable[[dict], ModelConfig]
    tiny_configs: dict[str, dict]
    layer_table: Callable[[ModelConfig, bool], list[LayerEntry]] = standard_layer_table
    trunk_prefix: Callable[[ModelConfig], str] = model_prefix
    ignored_prefixes: dict[str, str] = dataclasses.field(default_factory=dict)
    export_config: Callable[[ModelConfig, dict], dict] | None = None
    published_acceptance: tuple[float, str] | None = None


REGISTERED: list[Family] = []  # in registration order (mtp_jax/families/registry.py imports the modules)


def register(family: Family) -> Family:
    """Add `family` to the registry; a model_type another family already claims is a programming error."""
    taken = {t for f in REGISTERED for t in f.model_types} & set(family.model_types)
    if taken:
        raise ValueError(f"model types {sorted(taken)} are registered twice")
    REGISTERED.append(family)
    return family
