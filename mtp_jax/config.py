"""Frozen, hashable configurations: the model's shape (`ModelConfig`) and the decode settings (`DecodeConfig`).

Both are static arguments of jitted functions, so they are frozen dataclasses of plain Python values.
`ModelConfig` is built from a Hugging Face `config.json` by `checkpoints_convert.hf_config.model_config_from_hf`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

MtpLayout = Literal["deepseek", "mimo"]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `kind` is "default" (plain theta) or "llama3" (frequency-band scaling)."""

    theta: float = 10000.0
    kind: Literal["default", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """The MTP head(s) a checkpoint carries.

    layout: "deepseek" (`model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}`, concat [e, h]) or
            "mimo" (`model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`,
            concat [h, e]).
    num_layers: number of MTP modules; depth d uses module min(d, num_layers - 1).
    recurse_normed: for drafts of depth >= 2, feed back the MTP hidden after its final norm (True) or before
            it (False).
    draft_vocab_size: drafts use the first `draft_vocab_size` ids of `draft_vocab` (a frequency-ranked subset
            stored with the head); 0 means the full vocabulary.
    """

    layout: MtpLayout = "deepseek"
    num_layers: int = 1
    recurse_normed: bool = False
    draft_vocab_size: int = 0

    @property
    def concat_hidden_first(self) -> bool:
        return self.layout == "mimo"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and math switches of a dense decoder trunk (+ optional MTP head)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    mtp: MtpConfig | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None and self.mtp.num_layers > 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        raw = json.loads(text)
        raw["rope"] = RopeConfig(**raw["rope"])
        raw["mtp"] = MtpConfig(**raw["mtp"]) if raw.get("mtp") else None
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
        return cls(**raw)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static decode settings (part of the jit cache key).

    num_draft: drafts per round (k); 0 is plain decoding through the same loop.
    max_new_tokens: per-row budget of generated tokens.
    temperature / top_k / top_p: defaults for every row; per-row arrays passed to `generate` override them.
    stop_on_eos: stop a row at the model's EOS ids (a checkpoint without one decodes to max_new_tokens).
    """

    num_draft: int = 3
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_on_eos: bool = True

    def __post_init__(self):
        if self.num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {self.num_draft}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
