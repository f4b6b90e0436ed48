"""The generic dense decoder (embedding, scanned layer stack, final norm, lm_head) and its MTP head.

Forward passes are pure: caches go in and come out; parameters are read only. The decode loop splits a model
into (graphdef, params) and merges it inside jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache import KVCache
from mtp_jax.config import ModelConfig
from mtp_jax.models.layers import DecoderLayer, RMSNorm, _init, rope_inverse_frequencies, rope_tables


class LayerStack(nnx.Module):
    """`num_layers` decoder layers with stacked parameters (leading axis L), applied by `lax.scan`."""

    def __init__(self, cfg: ModelConfig, num_layers: int, *, dtype, rngs: nnx.Rngs | None):
        if rngs is None:
            self.layers = nnx.vmap(lambda _: DecoderLayer(cfg, dtype=dtype, rngs=None), in_axes=0, out_axes=0)(
                jnp.arange(num_layers)
            )
        else:

            @nnx.split_rngs(splits=num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(layer_rngs):
                return DecoderLayer(cfg, dtype=dtype, rngs=layer_rngs)

            self.layers = make(rngs)

    def __call__(self, x, positions, rope, cache: KVCache) -> tuple[jax.Array, KVCache]:
        graphdef, stacked = nnx.split(self.layers)  # every leaf of `stacked` has a leading L axis

        def run(x, layer_inputs):
            layer_params, past_k, past_v = layer_inputs  # past_k, past_v: [B, S, K, H], read only
            x, k, v = nnx.merge(graphdef, layer_params)(x, positions, rope, past_k, past_v)
            return x, (k, v)

        x, (new_k, new_v) = jax.lax.scan(run, x, (stacked, cache.k, cache.v))  # new_k: [L, B, T, K, H]
        # One scatter per cache after the stack: slot (row, position) of every layer gets this block's entry.
        rows = jnp.arange(x.shape[0])[:, None]  # [B, 1]
        k_all = cache.k.at[:, rows, positions].set(new_k.astype(cache.k.dtype), mode="drop")
        v_all = cache.v.at[:, rows, positions].set(new_v.astype(cache.v.dtype), mode="drop")
        return x, KVCache(k=k_all, v=v_all)


class MtpModule(nnx.Module):
    """One MTP block: fuse norm(embed(next token)) with norm(trunk hidden), one decoder layer, a final norm.

    DeepSeek layout concatenates [e, h]; MiMo's [h, e]. Logits come from the shared lm_head after `final_norm`.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.token_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.proj = nnx.Param(_init(rngs, (2 * d, d), dtype, 2 * d))  # [2D, D]
        self.block = LayerStack(cfg, 1, dtype=dtype, rngs=rngs)
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_first = cfg.mtp.concat_hidden_first

    def __call__(
        self,
        hidden: jax.Array,  # [B, T, D] trunk (or previous MTP) hidden at position p
        token_embeds: jax.Array,  # [B, T, D] embedding of the token at p + 1
        positions: jax.Array,  # [B, T]
        rope,
        cache: KVCache,  # [1, B, S, K, H]
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        e, h = self.token_norm(token_embeds), self.hidden_norm(hidden)
        fused = jnp.concatenate([h, e] if self.hidden_first else [e, h], axis=-1)  # [B, T, 2D]
        x = jnp.einsum("BTE,ED->BTD", fused, self.proj[...])
        x, cache = self.block(x, positions, rope, cache)
        return x, self.final_norm(x), cache


class CausalLM(nnx.Module):
    """Dense decoder trunk + tied or untied lm_head + optional MTP module."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = nnx.Param(_init(rngs, (v, d), dtype, 1))  # VD
        self.layers = LayerStack(cfg, cfg.num_layers, dtype=dtype, rngs=rngs)
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(_init(rngs, (d, v), dtype, d))  # DV
        self.mtp = MtpModule(cfg, dtype=dtype, rngs=rngs) if cfg.has_mtp else None
        if cfg.has_mtp and cfg.mtp.draft_vocab_size:
            self.draft_vocab = nnx.Variable(jnp.arange(cfg.mtp.draft_vocab_size, dtype=jnp.int32))  # [Vd]
        else:
            self.draft_vocab = None

    @property
    def dtype(self):
        return self.embed.dtype

    def new_cache(self, batch: int, slots: int) -> KVCache:
        """An empty trunk cache: [L, B, S, K, H] keys and values in the model's dtype."""
        return KVCache.zeros(self.config.num_layers, batch, slots, self.config, self.dtype)

    def new_mtp_cache(self, batch: int, slots: int) -> KVCache:
        """An empty MTP-layer cache: [1, B, S, K, H]."""
        return KVCache.zeros(1, batch, slots, self.config, self.dtype)

    def rope(self, positions: jax.Array):
        return rope_tables(positions, rope_inverse_frequencies(self.config.rope, self.config.head_dim))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
        return jnp.take(self.embed[...], tokens, axis=0)

    def trunk(self, tokens: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Final-normed hidden [B, T, D] for tokens [B, T] at positions [B, T]; the cache gains their keys."""
        with jax.named_scope("trunk"):
            x, cache = self.layers(self.embed_tokens(tokens), positions, self.rope(positions), cache)
            return self.final_norm(x), cache

    def head_weights(self) -> jax.Array:  # [D, V]
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] -> float32 logits [..., V]."""
        return jnp.einsum("...D,DV->...V", hidden, self.head_weights(), preferred_element_type=jnp.float32)

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 MTP logits [..., Vd] over the draft vocabulary (all V ids when it has no subset)."""
        if self.draft_vocab is None:
            return self.logits(hidden)
        weights = jnp.take(self.head_weights(), self.draft_vocab[...], axis=1)  # [D, Vd]
        return jnp.einsum("...D,DV->...V", hidden, weights, preferred_element_type=jnp.float32)

    def draft_ids(self, draft_index: jax.Array) -> jax.Array:
        """Token ids for indices into the draft vocabulary."""
        return draft_index if self.draft_vocab is None else jnp.take(self.draft_vocab[...], draft_index)

    def mtp_step(
        self,
        hidden: jax.Array,  # [B, T, D]
        next_tokens: jax.Array,  # [B, T]
        positions: jax.Array,  # [B, T]
        cache: KVCache,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """One MTP pass: (hidden to feed a deeper draft [B, T, D], normed hidden for logits [B, T, D], cache)."""
        with jax.named_scope("mtp"):
            raw, normed, cache = self.mtp(
                hidden, self.embed_tokens(next_tokens), positions, self.rope(positions), cache
            )
            return (normed if self.config.mtp.recurse_normed else raw), normed, cache
