"""Tiny tunix models (random, float32) for the rollout engine's tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen3 import model as qwen3

from mtp_jax.config.model import MtpConfig
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.rl.tunix_models import trunk_config

SHAPE = dict(num_layers=2, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2, norm_eps=1e-6)
ROUTED = dict(num_experts=6, num_experts_per_tok=2)  # "qwen3-moe": tunix's routed Qwen3, experts of width hidden_dim


def tiny_tunix_model(family: str = "llama3", seed: int = 0, vocab: int = 48, sharpness: float = 4.0,
                     context_scale: float = 1.0, logit_scale: float = 1.0):  # fmt: skip
    """A tunix model of `family` ("llama3", "llama3-tied", "qwen2", "qwen3", "qwen3-moe": Qwen3 routed, ROUTED),
    rope_theta 5e5 (not tunix's default), its query and key projections scaled by `sharpness` so that attention
    depends on positions (at tunix's initial scale it is nearly uniform, and a wrong rotary base would not show), and
    what its layers add to the residual stream by `context_scale` (below 1: a near-bigram model, which
    `predictable_head` drafts well), its untied lm_head by `logit_scale` (above 1: peakier next-token
    distributions). A routed model's experts are drawn at the scale of a dense layer's (tunix draws them at 0.01:
    they would hardly count)."""
    rngs = nnx.Rngs(seed)
    if family.startswith("llama3"):
        cfg = llama3.ModelConfig(**SHAPE, vocab_size=vocab, rope_theta=500_000, weight_tying=family.endswith("tied"))
        model = llama3.Llama3(cfg, rngs=rngs)
    else:
        module, cls = {"qwen2": (qwen2, "Qwen2"), "qwen3": (qwen3, "Qwen3"), "qwen3-moe": (qwen3, "Qwen3")}[family]
        routed = ROUTED if family == "qwen3-moe" else {}
        cfg = module.ModelConfig(**SHAPE, **routed, vocab_size=vocab, rope_theta=500_000, use_tied_embedding=False)
        model = getattr(module, cls)(cfg, rngs=rngs)
    for i, layer in enumerate(model.layers):
        for proj in (layer.attn.q_proj, layer.attn.k_proj):
            proj.w[...] = proj.w[...] * sharpness
        layer.attn.o_proj.w[...] = layer.attn.o_proj.w[...] * context_scale
        if isinstance(layer.mlp, qwen3.MoELayer):
            scale_experts(layer.mlp, jax.random.key(seed * 100 + i), context_scale)
        else:
            layer.mlp.down_proj.kernel[...] = layer.mlp.down_proj.kernel[...] * context_scale
    if hasattr(model, "lm_head"):
        model.lm_head.w[...] = model.lm_head.w[...] * logit_scale
    return model


def scale_experts(moe, key: jax.Array, context_scale: float) -> None:
    """tunix `moe`'s experts (gate, up [E, D, F], down [E, F, D]) drawn afresh ~ N(0, 1 / fan-in), the down
    projections times `context_scale`."""
    for name, k in zip(("gate_proj", "up_proj", "down_proj"), jax.random.split(key, 3), strict=True):
        w = getattr(moe, name)
        scale = w[...].shape[1] ** -0.5 * (context_scale if name == "down_proj" else 1.0)
        w[...] = scale * jax.random.normal(k, w[...].shape, w[...].dtype)


class CharTokenizer:
    """Characters as ids (BOS 1, EOS 2, then the alphabet below; 0 unused), with the methods tunix's tokenizer
    adapter asks of a tokenizer of its own kind. Padding is EOS, as tunix's adapter makes it for a tokenizer
    without a pad token: any other id a random model may sample mid-answer, where tunix's masks take it for
    padding."""

    ALPHABET = " abcdefghijklmnopqrstuvwxyz0123456789.,?!+=-*"

    def encode(self, text: str, **kwargs) -> list[int]:
        return [3 + self.ALPHABET.index(c) for c in text.lower() if c in self.ALPHABET]

    def decode(self, ids, **kwargs) -> str:
        return "".join(self.ALPHABET[i - 3] if 3 <= i < 3 + len(self.ALPHABET) else "" for i in ids)

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 2


def predictable_head(tunix_model, seed: int = 0, noise: float = 0.02):
    """A `CausalLM` holding a DeepSeek-layout MTP head for `tunix_model`'s trunk that applies the trunk's bigram map
    to its input token (its projection selects the token's embedding, its block nearly silent): for a near-bigram
    trunk (`context_scale` < 1) its drafts are mostly, not always, right."""
    cfg = trunk_config(tunix_model, eos_token_ids=(2,), context=64).replace(mtp=MtpConfig(layout="deepseek"))
    model = CausalLM(cfg, rngs=nnx.Rngs(seed))
    d = cfg.hidden_size
    select_token = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)  # [2D, D]: the embedding half
    model.mtp.proj[...] = select_token + noise * jax.random.normal(jax.random.key(seed), select_token.shape)
    block = model.mtp.block.layers
    block.attn.o_proj[...] = block.attn.o_proj[...] * noise
    down = block.mlp.down_proj if cfg.moe is None else block.mlp.expert_down  # [F, D] or [E, F, D]
    down[...] = down[...] * noise
    return model
