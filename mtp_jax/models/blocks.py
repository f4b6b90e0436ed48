"""The block registry: a layer's token mixer and MLP by the names `ModelConfig` gives them (`LayerKind.attention`,
`LayerKind.mlp`). models/causal_lm.py's layer stacks and models/hybrid_stack.py's layer groups take their blocks
from here; the gated DeltaNet mixer (kind "deltanet") is built by hybrid_stack.py itself."""

from __future__ import annotations

from mtp_jax.models.gated_attention import GatedAttention
from mtp_jax.models.layers import Attention, SwiGLU
from mtp_jax.models.mla import MultiHeadLatentAttention
from mtp_jax.models.moe import MoE
from mtp_jax.models.softmax_moe import SoftmaxMoE

ATTENTION_BLOCKS = {"gqa": Attention, "mla": MultiHeadLatentAttention, "gated": GatedAttention}
MLP_BLOCKS = {"dense": SwiGLU, "moe": MoE, "softmax_moe": SoftmaxMoE}
