"""Frozen, hashable configurations: the model's shape (`ModelConfig`) and the decode settings (`DecodeConfig`).

Both are static arguments of jitted functions, so they are frozen dataclasses of plain Python values.
`ModelConfig` is built from a Hugging Face `config.json` by `mtp_jax.families.registry.model_config_from_hf`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

LAYER_LAYOUTS = ("auto", "stacked", "unstacked")  # how layer parameters are held: models.causal_lm.apply_layer_layout

MtpLayout = Literal["deepseek", "mimo", "qwen_next"]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    kind: "default" (plain theta), "llama3" (frequency-band scaling) or "yarn" (NTK-by-parts interpolation between
        `factor`-scaled and unscaled frequencies, ramped over `beta_fast`..`beta_slow` rotations).
    attention_factor: cos and sin are multiplied by it (yarn's mscale ratio; 1 otherwise).
    mscale_all_dim: yarn models with MLA also scale the softmax by (0.1 * mscale_all_dim * ln(factor) + 1)^2
        (DeepSeek); 0 leaves the softmax scale alone.
    partial_factor: the fraction of each head's dims that rotate, the leading ones (GLM: 0.5).
    interleaved: rotary pairs are adjacent dims (x0, x1), (x2, x3), ... (DeepSeek) instead of the two halves.
    """

    theta: float = 10000.0
    kind: Literal["default", "llama3", "yarn"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    mscale_all_dim: float = 0.0
    partial_factor: float = 1.0
    interleaved: bool = False


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are up-projected from a per-token latent of
    `kv_lora_rank` dims, which (with the shared rotary key of `qk_rope_head_dim` dims) is all the cache holds.

    q_lora_rank: rank of the query's low-rank path (q_a_proj -> norm -> q_b_proj); 0 means a plain q_proj.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached dims per token and layer: the latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Routed experts replacing the dense MLP from layer `first_dense_layers` on.

    Routing: sigmoid scores; the correction bias is added for selection only; experts are picked among the
    `topk_groups` best of `num_groups` groups (a group scores the sum of its two best experts); the picked scores,
    normalised to sum 1 when `norm_topk_prob`, times `routed_scaling_factor`, weight the expert outputs.
    `num_shared_experts` shared experts (one SwiGLU of width num_shared_experts * expert_intermediate_size) see
    every token.
    scoring "softmax" (Qwen3-Next, Qwen3.5-MoE; models/softmax_moe.py): softmax over every expert, the top
    `experts_per_token` picked (no bias, no groups), renormalised when `norm_topk_prob`; one shared expert of width
    `shared_intermediate_size` whose output each token gates with a sigmoid.
    """

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_dense_layers: int = 0
    scoring: Literal["sigmoid", "softmax"] = "sigmoid"
    shared_intermediate_size: int = 0

    @property
    def shared_width(self) -> int:
        """Width of the shared expert SwiGLU (0: none)."""
        return self.shared_intermediate_size or self.num_shared_experts * self.expert_intermediate_size

    def __post_init__(self):
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must be a multiple of n_group ({self.num_groups})")
        if self.num_experts // self.num_groups < 2:
            raise ValueError("each expert group needs at least 2 experts (a group scores its two best)")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group ({self.topk_groups}) must be in 1..n_group ({self.num_groups})")
        if not 1 <= self.experts_per_token <= self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"num_experts_per_tok ({self.experts_per_token}) must be in 1..{self.topk_groups} groups x "
                f"{self.num_experts // self.num_groups} experts"
            )


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Shape of a gated DeltaNet layer (HF: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim; the gated norm uses rms_norm_eps)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim ({self.conv_kernel}) must be at least 1")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Conv channels: q and k of every key head, v of every value head."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one decoder layer is made of: its token mixer and its MLP.

    attention: "gqa", "mla" (latent), "gated" (GQA with an output gate, Qwen3-Next / 3.5) or "deltanet" (gated
        DeltaNet linear attention, whose cache is a recurrent state instead of keys and values).
    mlp: "dense", "moe" (sigmoid-routed, DeepSeek style) or "softmax_moe" (Qwen3-Next / 3.5 style).
    """

    attention: Literal["gqa", "mla", "gated", "deltanet"] = "gqa"
    mlp: Literal["dense", "moe", "softmax_moe"] = "dense"


@dataclasses.dataclass(frozen=True)
class Segment:
    """`count` repeats of a group of consecutive layers, from checkpoint layer `start`: one scanned stack.

    kind: the group's first layer kind; `group` lists one kind per layer of a repeat when it has several (a hybrid
    trunk's "3 DeltaNet layers then 1 attention layer"), and is empty for a plain run of `count` layers of `kind`.
    """

    kind: LayerKind
    start: int
    count: int
    group: tuple[LayerKind, ...] = ()

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """One kind per layer of a repeat."""
        return self.group or (self.kind,)

    @property
    def num_layers(self) -> int:
        return self.count * len(self.kinds)

    @property
    def scanned_as_group(self) -> bool:
        """Run by models/hybrid_stack.py's GroupStack (a group, or recurrent layers); else by a LayerStack."""
        return bool(self.group) or self.kind.attention == "deltanet"


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
    own_embedding / own_head: the MTP layer has its own embedding / output head (the checkpoint's copies differ
            from the trunk's); by default it shares the trunk's.
    block_layers: decoder layers stacked in the MTP module (1 in every released checkpoint; a head trained here
            may stack more, the extra ones saved as `{module}.block_layers.{i}.*`, i >= 1).
    fused_layers: trunk layers (0-based) whose outputs (the residual stream after the layer) join the trunk's
            final-normed hidden in the hidden the MTP layer reads (EAGLE-3's fused features): each normed by one
            shared norm, then [h, l_1, .., l_n] projected to D (`MtpModule.feature_proj`). Empty (every released
            checkpoint): the final hidden alone. Heads trained here only; not beside recurrent (hybrid) trunks.
    Layout "qwen_next" (Qwen3-Next, Qwen3.5 / 3.6): `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}` and
            `mtp.layers.0.*`, concat [e, h].
    """

    layout: MtpLayout = "deepseek"
    num_layers: int = 1
    recurse_normed: bool = False
    draft_vocab_size: int = 0
    own_embedding: bool = False
    own_head: bool = False
    block_layers: int = 1
    fused_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "fused_layers", tuple(int(i) for i in self.fused_layers))  # a list read from JSON

    @property
    def concat_hidden_first(self) -> bool:
        return self.layout == "mimo"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and math switches of a decoder trunk (+ optional MTP head).

    Attention is grouped-query unless `mla` is set; MLPs are dense SwiGLUs unless `moe` is set, in which case layers
    from `moe.first_dense_layers` on are routed-expert layers. `segments()` groups the layers into runs of one kind.
    Hybrid trunks (Qwen3-Next, Qwen3.5 / 3.6): `layer_types` names each layer "linear_attention" (a gated DeltaNet
    of shape `linear_attention`) or "full_attention" (gated when `gated_attention`); `zero_centered_norms`: every
    RMSNorm multiplies by (1 + w).
    """

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
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    linear_attention: GatedDeltaNetConfig | None = None
    layer_types: tuple[str, ...] = ()
    gated_attention: bool = False
    zero_centered_norms: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope.interleaved and self.mla is None:
            raise ValueError("interleaved rotary is only supported with multi-head latent attention")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"the rotary dims per head ({self.rotary_dim}) must be even and at least 2")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported (linear_attention, full_attention)")
        if "linear_attention" in self.layer_types and self.linear_attention is None:
            raise ValueError("linear_attention layers need the gated DeltaNet shape (linear_attention)")
        fused = self.mtp.fused_layers if self.mtp is not None else ()
        if fused and (sorted(set(fused)) != list(fused) or fused[0] < 0 or fused[-1] >= self.num_layers - 1):
            raise ValueError(f"fused_layers {list(fused)}: distinct increasing layers in 0..{self.num_layers - 2} "
                             "(the last layer's output is the final hidden, always read)")  # fmt: skip
        if fused and "linear_attention" in self.layer_types:
            raise ValueError("fused_layers: a trunk of recurrent (gated DeltaNet) layers keeps no per-layer hiddens")

    @property
    def rotary_dim(self) -> int:
        """Dims per head that rotate: MLA's rotary key dims, else the leading `partial_factor` of the head."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_factor)

    def layer_kind(self, index: int) -> LayerKind:
        """The kind of trunk layer `index` (index `num_layers` and beyond: the MTP layers, always MoE when the
        model has experts)."""
        moe = self.moe is not None and index >= min(self.moe.first_dense_layers, self.num_layers)
        mlp = ("softmax_moe" if self.moe.scoring == "softmax" else "moe") if moe else "dense"
        if index < len(self.layer_types) and self.layer_types[index] == "linear_attention":
            return LayerKind(attention="deltanet", mlp=mlp)
        attention = "gated" if self.gated_attention else "gqa" if self.mla is None else "mla"
        return LayerKind(attention=attention, mlp=mlp)

    @property
    def mtp_layer_kind(self) -> LayerKind:
        return self.layer_kind(self.num_layers)

    def segments(self) -> tuple[Segment, ...]:
        """The trunk's layers as runs of one kind, in order; a hybrid trunk's as repeated groups (`hybrid_segments`)."""
        kinds = [self.layer_kind(i) for i in range(self.num_layers)]
        if any(kind.attention == "deltanet" for kind in kinds):
            return hybrid_segments(kinds)
        segments: list[Segment] = []
        for i in range(self.num_layers):
            kind = self.layer_kind(i)
            if segments and segments[-1].kind == kind:
                segments[-1] = dataclasses.replace(segments[-1], count=segments[-1].count + 1)
            else:
                segments.append(Segment(kind, i, 1))
        return tuple(segments)

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None and self.mtp.num_layers > 0

    @property
    def is_hybrid(self) -> bool:
        """Some trunk layers are gated DeltaNets (a recurrent state to roll back by replay)."""
        return "linear_attention" in self.layer_types

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def hybrid_segments(kinds: list[LayerKind]) -> tuple[Segment, ...]:
    """Layers of a hybrid trunk as few scanned segments: from each start, the repeated group (a group of p layers
    repeated c >= 2 times, or a single layer's run) that covers the most layers, the shorter group on ties."""
    segments: list[Segment] = []
    start = 0
    while start < len(kinds):
        best = (1, 1)  # (group length, repeats)
        for period in range(1, (len(kinds) - start) + 1):
            group = kinds[start : start + period]
            repeats = 1
            while kinds[start + repeats * period : start + (repeats + 1) * period] == group:
                repeats += 1
            if (period == 1 or repeats >= 2) and period * repeats > best[0] * best[1]:
                best = (period, repeats)
        period, repeats = best
        group = tuple(kinds[start : start + period])
        segments.append(Segment(group[0], start, repeats, group if period > 1 else ()))
        start += period * repeats
    return tuple(segments)
