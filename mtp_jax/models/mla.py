"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of compressed latents.

Each token is cached as one latent row: the normed kv latent (R dims) followed by the rotary key shared by all
heads (P dims) — no head axis. Keys and values are up-projected from the latent by `kv_b_proj`. Two equal ways to
attend, picked by the query block's length:
  expanded: up-project the cached latents to per-head keys and values, then attend (cheap for long blocks, e.g. a
            prompt);
  absorbed: fold the key up-projection into the queries and the value up-projection into the output, and attend
            over the latents directly (cheap for short blocks: decode and verify steps never expand the cache).
A cache split over its slots (cache_attention.py) is always attended absorbed: expanding its chunks would need every
head's up-projection beside every shard of the slots.

Einsum letters (with those of layers.py): Q query LoRA rank, R kv latent rank, C cached dims (R + P), P rotary
dims per head, H non-rotary query/key dims per head, W value dims per head, J = H + P, I = H + W, U keys within
the new block (B counting the M * B rows of every shard in a chunk's einsums: cache_attention.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config.model import ModelConfig, RopeConfig
from mtp_jax.kernels.dispatch import attention_rows_exact, float32_product, product, project, row_product
from mtp_jax.models.cache_attention import (
    ATTENTION_CHUNK,
    AttentionForm,
    LayerSlots,
    attend_in_chunks,
    attend_written_cache,
    past_and_block_probs,
    read_chunks,
    read_slots,
    two_rows,
    whole_chunk_runs,
    with_block,
)
from mtp_jax.models.layers import RMSNorm, apply_rope, init_weight
from mtp_jax.ops.stacked_weights import layer_value
from mtp_jax.parallel.sharding import (
    HEADS,
    LATENT_CACHE,
    constrain,
    constrain_beside_slots,
    slot_shards,
)
from mtp_jax.quant.matmul_axes import MatmulAxes
from mtp_jax.quant.quantized_array import QuantizedArray, block_parts


def yarn_softmax_mscale(rope: RopeConfig) -> float:
    """The factor DeepSeek applies (squared) to the softmax scale under yarn: 0.1 * mscale_all_dim * ln(factor) + 1."""
    if rope.kind != "yarn" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    return 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0


class MultiHeadLatentAttention(nnx.Module):
    """DeepSeek's MLA: optional query LoRA, a shared rotary key, keys/values up-projected from a cached latent."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        m, d, n = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.nope_dim, self.rope_dim, self.latent_rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        by_first = MatmulAxes((0,))  # products over D, Q or R
        if m.q_lora_rank:
            # the low-rank projections and the latent are shared by all heads: their rank is no model axis
            q_a = init_weight(rngs, (d, m.q_lora_rank), dtype, d)
            self.q_a_proj = nnx.Param(q_a, axes=("embed", None), matmul=by_first)  # DQ
            self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, dtype=dtype, axes=(None,))
            q_b = init_weight(rngs, (m.q_lora_rank, n, m.qk_head_dim), dtype, m.q_lora_rank)
            self.q_b_proj = nnx.Param(q_b, axes=(None, "heads", "head_dim"), matmul=by_first)  # QNJ
            self.q_proj = None
        else:
            q = init_weight(rngs, (d, n, m.qk_head_dim), dtype, d)
            self.q_proj = nnx.Param(q, axes=("embed", "heads", "head_dim"), matmul=by_first)  # DNJ
        kv_a = init_weight(rngs, (d, m.latent_dim), dtype, d)
        self.kv_a_proj = nnx.Param(kv_a, axes=("embed", None), matmul=by_first)  # DC
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, dtype=dtype, axes=(None,))
        kv_b_shape = (m.kv_lora_rank, n, m.qk_nope_head_dim + m.v_head_dim)
        kv_b = init_weight(rngs, kv_b_shape, dtype, m.kv_lora_rank)
        in_parts = MatmulAxes((0,), split_reads=True)  # absorbed attention reads its K and V parts apart (block_parts)
        self.kv_b_proj = nnx.Param(kv_b, axes=(None, "heads", "head_dim"), matmul=in_parts)  # RNI
        o = init_weight(rngs, (n, m.v_head_dim, d), dtype, n * m.v_head_dim)
        self.o_proj = nnx.Param(o, axes=("heads", "head_dim", "embed"), matmul=MatmulAxes((0, 1)))  # NWD: over N, W
        self.interleaved = cfg.rope.interleaved
        self.scale = yarn_softmax_mscale(cfg.rope) ** 2 / math.sqrt(m.qk_head_dim)

    def queries(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, N, H+P]
        if self.q_proj is not None:
            return project("BTD,DNJ->BTNJ", x, self.q_proj.get_value())
        q_latent = self.q_a_norm(project("BTD,DQ->BTQ", x, self.q_a_proj.get_value()))
        return project("BTQ,QNJ->BTNJ", q_latent, self.q_b_proj.get_value())

    def latents(self, x: jax.Array, rope) -> jax.Array:  # [B, T, D] -> [B, T, C]: what the cache stores
        kv = project("BTD,DC->BTC", x, self.kv_a_proj.get_value())
        latent = self.kv_a_norm(kv[..., : self.latent_rank])  # [B, T, R]
        rope_key = apply_rope(kv[:, :, None, self.latent_rank :], *rope, interleaved=self.interleaved)[:, :, 0]
        return jnp.concatenate([latent, rope_key], axis=-1)

    def absorbs(self, block_len: int) -> bool:
        """Whether attending over latents costs fewer flops than expanding them, per cached slot: absorbed spends
        T * (2R + P) per head, expanded R * (H + W) to expand plus T * (H + P + W) to attend."""
        value_dim = self.kv_b_proj.shape[-1] - self.nope_dim
        absorbed = block_len * (2 * self.latent_rank + self.rope_dim)
        expanded = self.latent_rank * (self.nope_dim + value_dim) + block_len * (
            self.nope_dim + self.rope_dim + value_dim
        )
        return absorbed < expanded

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        positions: jax.Array,  # [B, T] absolute positions, contiguous per row
        rope: tuple[jax.Array, jax.Array],  # cos, sin [B, T, P]
        past: jax.Array | LayerSlots,  # [B, S, C] this layer's latent cache; slots >= positions[:, 0] are ignored
        absorb: bool | None = None,
        visible_from: jax.Array | None = None,  # [B]: slots before it are ignored too
        attention: AttentionForm = AttentionForm.ONE_PASS,  # the cache's form (models/cache_attention.py)
        block_mask: jax.Array | None = None,  # [B, T, T]: the block entries each query sees (None: causally)
    ) -> tuple[jax.Array, jax.Array]:
        """(output [B, T, D], this block's latents [B, T, C]); `absorb` None picks the cheaper way for the block's
        length (absorbed over a cache split over its slots, and always in the invariant form, whose arithmetic may
        not depend on the block's length)."""
        q = self.queries(x)
        q_nope = q[..., : self.nope_dim]  # [B, T, N, H]
        q_rope = apply_rope(q[..., self.nope_dim :], *rope, interleaved=self.interleaved)  # [B, T, N, P]
        block = self.latents(x, rope)  # [B, T, C]
        shards = slot_shards(LATENT_CACHE[1:], past.shape, ATTENTION_CHUNK)
        invariant = attention == AttentionForm.INVARIANT
        if absorb is None:
            absorb = invariant or shards > 1 or self.absorbs(x.shape[1])
        if invariant and not absorb:
            raise ValueError("the batch-invariant form of latent attention attends absorbed")
        if invariant and block_mask is not None:
            raise ValueError("the batch-invariant form of latent attention takes no block mask (draft trees)")
        q_nope, q_rope = q_nope * self.scale, q_rope * self.scale
        if invariant:
            out = self._absorbed_invariant(q_nope, q_rope, past, block, positions, visible_from, x.dtype, shards)
        else:
            attend = self._absorbed if absorb else self._expanded
            chunked = attention == AttentionForm.CHUNKED
            out = attend(q_nope, q_rope, past, block, positions, visible_from, x.dtype, shards, chunked, block_mask)
        return project("BTNW,NWD->BTD", out, self.o_proj.get_value()), block

    def _up_projections(self):
        """(W_uk [R, N, H], W_uv [R, N, W]): kv_b's key and value halves for the absorbed products, kept as stored
        where each half lies in one block of kv_b's scales along its last axis (fp8's 128-wide blocks: the products
        then read the float8 values, not a weight dequantized at every step), else dequantized (int8's one scale per
        output channel would put a scale on every element of the axis the key product contracts)."""
        kv_b = layer_value(self.kv_b_proj.get_value())
        if isinstance(kv_b, QuantizedArray):
            parts = block_parts(kv_b, 2, (self.nope_dim, kv_b.shape[2] - self.nope_dim))
            if parts is not None:
                return tuple(parts)
            kv_b = kv_b.dequantize()
        return kv_b[..., : self.nope_dim], kv_b[..., self.nope_dim :]

    def _expanded(
        self, q_nope, q_rope, past, block, positions, visible_from, dtype, shards: int, chunked: bool, block_mask=None
    ):
        """Per-head keys and values from every latent, then ordinary attention (`chunked`: chunk by chunk, expanding
        one chunk of each of the `shards` runs of slots at a time)."""
        kv_b = self.kv_b_proj[...]
        f32 = jnp.float32

        def keys_values(latents):  # [B, S, C] -> keys [B, S, N, H], values [B, S, N, W], rotary keys [B, S, P]
            kv = project("BSR,RNI->BSNI", latents[..., : self.latent_rank], kv_b)
            return kv[..., : self.nope_dim], kv[..., self.nope_dim :], latents[..., self.latent_rank :]

        def scores_and_values(latents, q_nope=q_nope, q_rope=q_rope):  # [B, S, C] -> float32 [B, N, T, S], [B, S, N, W]
            keys, values, rope_keys = keys_values(latents.astype(dtype))
            scores = jnp.einsum("BTNH,BSNH->BNTS", q_nope, keys, preferred_element_type=f32)
            return scores + jnp.einsum("BTNP,BSP->BNTS", q_rope, rope_keys, preferred_element_type=f32), values

        def output(probs, values):  # [B, N, T, S], [B, S, N, W] -> [B, T, N, W]
            return jnp.einsum("BNTS,BSNW->BTNW", probs.astype(values.dtype), values, preferred_element_type=f32)

        block_scores, block_v = scores_and_values(block)
        if chunked:
            rows = jnp.tile(q_nope, (shards, 1, 1, 1)), jnp.tile(q_rope, (shards, 1, 1, 1))  # [M * B, T, N, .]

            def attend_chunk(first):  # a chunk of each shard: [M * B, S, C], S its slots
                scores, values = scores_and_values(read_chunks(past, first, ATTENTION_CHUNK, shards), *rows)
                return scores, lambda probs: output(probs, values)

            out = attend_in_chunks(attend_chunk, block_scores, lambda probs: output(probs, block_v), positions,
                                   visible_from, past.shape[1], shards, block_mask)  # fmt: skip
            return out.astype(dtype)
        past_scores, past_v = scores_and_values(read_slots(past))
        past_probs, block_probs = past_and_block_probs(past_scores, block_scores, positions, visible_from, block_mask)
        out = jnp.einsum("BNTS,BSNW->BTNW", past_probs.astype(past_v.dtype), past_v)
        return out + jnp.einsum("BNTU,BUNW->BTNW", block_probs.astype(block_v.dtype), block_v)

    def _absorbed(
        self, q_nope, q_rope, past, block, positions, visible_from, dtype, shards: int, chunked: bool, block_mask=None
    ):
        """Queries moved into latent space (q_nope . W_uk), attention over latents (`chunked`: chunk by chunk, every
        head beside each of the `shards` runs of slots), W_uv applied to the result."""
        w_uk, w_uv = self._up_projections()  # [R, N, H], [R, N, W]
        f32 = jnp.float32
        r = self.latent_rank
        q_latent = project("BTNH,RNH->BTNR", q_nope, w_uk)
        query = jnp.concatenate([q_latent, q_rope], axis=-1)  # [B, T, N, C]: matches a cached row [latent, rope]
        if shards > 1:
            query = constrain_beside_slots(query, LATENT_CACHE[1:], past.shape, ATTENTION_CHUNK)
        block_scores = jnp.einsum("BTNC,BUC->BNTU", query, block, preferred_element_type=f32)
        if chunked:
            query_rows = jnp.tile(query, (shards, 1, 1, 1))  # [M * B, T, N, C]
            query_rows = constrain_beside_slots(query_rows, LATENT_CACHE[1:], past.shape, ATTENTION_CHUNK)

            def attend_chunk(first):
                # [M * B, S, C], S: a chunk. The barrier keeps attention's preferred layout from reaching back to the
                # layer stack (compiled for TPU, XLA copied a segment's whole latent cache into it at every step).
                latents = jax.lax.optimization_barrier(read_chunks(past, first, ATTENTION_CHUNK, shards)).astype(dtype)
                scores = jnp.einsum("BTNC,BSC->BNTS", query_rows, latents, preferred_element_type=f32)
                return scores, lambda probs: float32_product("BNTS,BSR->BTNR", probs.astype(dtype), latents[..., :r])

            def block_output(probs):  # [B, N, T, U] -> [B, T, N, R]
                return jnp.einsum(
                    "BNTU,BUR->BTNR", probs.astype(block.dtype), block[..., :r], preferred_element_type=f32
                )

            out_latent = attend_in_chunks(attend_chunk, block_scores, block_output, positions, visible_from,
                                          past.shape[1], shards, block_mask).astype(dtype)  # fmt: skip
            if shards > 1:
                out_latent = constrain(out_latent, HEADS)
            return project("BTNR,RNW->BTNW", out_latent, w_uv)
        past = read_slots(past).astype(dtype)
        past_scores = jnp.einsum("BTNC,BSC->BNTS", query, past, preferred_element_type=f32)
        past_probs, block_probs = past_and_block_probs(past_scores, block_scores, positions, visible_from, block_mask)
        out_latent = jnp.einsum("BNTS,BSR->BTNR", past_probs.astype(past.dtype), past[..., :r])
        out_latent += jnp.einsum("BNTU,BUR->BTNR", block_probs.astype(block.dtype), block[..., :r])
        return project("BTNR,RNW->BTNW", out_latent, w_uv)

    def _absorbed_invariant(self, q_nope, q_rope, past, block, positions, visible_from, dtype, shards: int):
        """`_absorbed` in the batch-invariant form (cache_attention.attend_written_cache): the block's latents
        written into the chunks first, each query attending to the slots up to its own position."""
        w_uk, w_uv = self._up_projections()  # [R, N, H], [R, N, W]
        r, slots = self.latent_rank, past.shape[1]
        query = jnp.concatenate([project("BTNH,RNH->BTNR", q_nope, w_uk), q_rope], axis=-1)  # [B, T, N, C]
        if shards > 1:
            query = constrain_beside_slots(query, LATENT_CACHE[1:], past.shape, ATTENTION_CHUNK)
        query_rows = jnp.tile(query, (shards, 1, 1, 1))  # [M * B, T, N, C]
        run_starts, entries = whole_chunk_runs(slots, shards), block.astype(past.dtype)  # as the cache will hold it
        exact_rows = attention_rows_exact(dtype)  # no twin for a lone row (dispatch.row_product)
        widen = two_rows if not exact_rows and query_rows.shape[0] == 1 else lambda x: x
        scores_of, output_of = (row_product, row_product) if exact_rows else (product, float32_product)
        query_rows = widen(query_rows)

        def attend_chunk(first):
            chunk = read_chunks(past, first, ATTENTION_CHUNK, shards)  # [M * B, S, C], S: a chunk
            latents = widen(with_block(chunk, entries, positions, run_starts + first)).astype(dtype)
            scores = scores_of("BTNC,BSC->BNTS", query_rows, latents)
            return scores, lambda probs: output_of("BNTS,BSR->BTNR", probs.astype(dtype), latents[..., :r])

        b, t, n, _ = query.shape
        rows = widen(positions), None if visible_from is None else widen(visible_from)
        wide = rows[0].shape[0]
        out_latent = attend_written_cache(attend_chunk, *rows, slots, shards, (wide, n, t), (wide, t, n, r))
        out_latent = out_latent[:b].astype(dtype)
        if shards > 1:
            out_latent = constrain(out_latent, HEADS)
        return project("BTNR,RNW->BTNW", out_latent, w_uv)
