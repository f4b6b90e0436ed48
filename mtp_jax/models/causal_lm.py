"""The generic decoder (embedding, segments of scanned layer stacks, final norm, lm_head) and its MTP head.

The trunk is a sequence of segments (`ModelConfig.segments()`): runs of consecutive layers of one kind (GQA, latent
or gated attention; dense or routed-expert MLP), each one stacked and scanned, each with its own cache; in hybrid
trunks, repeated groups of gated DeltaNet and gated attention layers (models/hybrid_stack.py), whose cache also
holds recurrent states. The trunk cache is always a tuple of the segments' caches (one entry for every dense
family).

Forward passes are pure: caches go in and come out; parameters are read only. The decode loop splits a model
into (graphdef, params) and merges it inside jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config.model import LAYER_LAYOUTS, LayerKind, ModelConfig, Segment
from mtp_jax.kernels import traced_plan
from mtp_jax.kernels.dispatch import project
from mtp_jax.models.block_tree import BlockTree
from mtp_jax.models.blocks import ATTENTION_BLOCKS, MLP_BLOCKS
from mtp_jax.models.cache_attention import AttentionForm, layer_entries
from mtp_jax.models.hybrid_stack import GroupStack, RecurrentForm
from mtp_jax.models.kv_cache import GroupCache, attention_cache, write_slots
from mtp_jax.models.layers import DecoderLayer, init_weight, model_norm, rope_inverse_frequencies, rope_tables
from mtp_jax.ops import loops
from mtp_jax.ops.stacked_weights import layer_parameters, split_stack, stack_split_of
from mtp_jax.parallel.sharding import DRAFT_HEAD, HIDDEN, LOGITS, constrain, param_layouts
from mtp_jax.quant.fp8 import hold_float8_as_bits
from mtp_jax.quant.matmul_axes import MatmulAxes, param_matmuls
from mtp_jax.quant.quantized_array import is_quantized, take_columns, take_quantized_rows, take_rows

# Embeddings [V, D] (a tied lm_head's product "...D,VD->...V" sums over D) and lm_heads [D, V] (summed over D): read
# a vocabulary entry at a time too.
EMBEDDING = MatmulAxes((1,), vocabulary=True)
LM_HEAD = MatmulAxes((0,), vocabulary=True)


class LayerStack(nnx.Module):
    """`num_layers` decoder layers of one kind with stacked parameters (leading axis L), applied by `lax.scan`; or,
    once `unstack`ed, held and applied one by one."""

    def __init__(self, cfg: ModelConfig, num_layers: int, *, kind: LayerKind, dtype, rngs: nnx.Rngs | None):
        blocks = dict(attention=ATTENTION_BLOCKS[kind.attention], mlp=MLP_BLOCKS[kind.mlp])
        self.config, self.kind, self.num_layers = cfg, kind, num_layers
        if rngs is None:
            self.layers = nnx.vmap(
                lambda _: DecoderLayer(cfg, dtype=dtype, rngs=None, **blocks), in_axes=0, out_axes=0
            )(jnp.arange(num_layers))
        else:

            @nnx.split_rngs(splits=num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(layer_rngs):
                return DecoderLayer(cfg, dtype=dtype, rngs=layer_rngs, **blocks)

            self.layers = make(rngs)

    def unstack(self) -> None:
        """Hold each layer's parameters as arrays of their own (`unstack_layers`)."""
        if not isinstance(self.layers, nnx.List):
            self.layers = nnx.List(loops.unstacked_modules(self.layers, self.num_layers))

    def new_cache(self, batch: int, slots: int, dtype, attention: AttentionForm | None = None):
        """An empty cache for this stack: KVCache [L, B, S, K, H] (GQA) or LatentCache [L, B, S, C] (MLA)."""
        return attention_cache(self.kind, self.num_layers, batch, slots, self.config, dtype, attention)

    def __call__(
        self,
        x,
        positions,
        rope,
        cache,
        lengths=None,
        recurrent: RecurrentForm = RecurrentForm.CHUNKED,
        visible_from=None,
        block_mask=None,
    ):
        """x [B, T, D] through every layer; returns (x, the cache with this block's entries at slots
        positions[:, 0] onwards, one after another). `lengths` and `recurrent` concern recurrent layers only
        (models/hybrid_stack.py): attention caches roll back by length. `visible_from` [B]: cache slots before it
        are not attended to (None: all are). `block_mask` [B, T, T]: the block entries each position sees (a draft
        tree's, whose positions go by depth; None: causally)."""
        x, cache, _ = self.tapped(x, positions, rope, cache, visible_from=visible_from, block_mask=block_mask)
        return x, cache

    def tapped(self, x, positions, rope, cache, taps: tuple[int, ...] = (), visible_from=None, block_mask=None):
        """`__call__`, also returning the outputs of the stack's layers `taps` (indices in the stack, increasing):
        (x, cache, [len(taps), B, T, D] or None without taps)."""
        past = jax.tree.leaves(cache.constrained())  # each [L, B, S, ...], in the order the layers take them
        tap_index = jnp.asarray(taps, jnp.int32)  # [N]

        def run(layer, carry, index):
            x, outputs = carry
            layer_past = [layer_entries(entries, index) for entries in past]  # a scan's: read in place
            x, *new = layer(
                x,
                positions,
                rope,
                *layer_past,
                visible_from=visible_from,
                attention=cache.attention,
                block_mask=block_mask,
            )
            if taps:  # [N, B, T, D]: the tap at this layer takes its output
                outputs = jnp.where((tap_index == index)[:, None, None, None], x[None], outputs)
            return (x, outputs), tuple(new)

        start = (x, jnp.zeros((len(taps), *x.shape), x.dtype) if taps else None)
        if isinstance(self.layers, nnx.List):  # unstacked (`unstack_layers`): one call per layer, in order
            (x, outputs), new = loops.each_layer(run, start, list(self.layers))
        else:
            graphdef, stacked = nnx.split(self.layers)  # every leaf of `stacked` has a leading L axis
            keep, experts_only = stack_split_of(traced_plan.current())
            whole, sliced = split_stack(stacked, experts_only) if keep else (None, stacked)
            step = lambda carry, inputs: run(nnx.merge(graphdef, layer_parameters(whole, *inputs)), carry, inputs[1])
            (x, outputs), new = loops.scan(step, start, (sliced, jnp.arange(self.num_layers)))  # new: [L, B, T, ...]
        # One scatter per cache array after the stack: slot (row, position) of every layer gets this block's entry.
        updated = [write_slots(old, entry, positions) for old, entry in zip(past, new, strict=True)]
        return x, jax.tree.unflatten(jax.tree.structure(cache), updated).constrained(), outputs


class MtpModule(nnx.Module):
    """One MTP block: fuse norm(embed(next token)) with norm(trunk hidden), decoder layer(s), a final norm.

    DeepSeek and Qwen3-Next / 3.5 layouts concatenate [e, h]; MiMo's [h, e]. Logits come from the shared lm_head
    after `final_norm`, and tokens are embedded with the trunk's embedding, unless the checkpoint gave the MTP layer
    its own copies (`embed` [V, D], `head` [D, V]). The block is `mtp.block_layers` layers (one in released
    checkpoints) of the trunk's kind (gated attention in hybrid trunks), with routed experts when the trunk has them.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, v = cfg.hidden_size, cfg.vocab_size
        self.token_norm = model_norm(cfg, d, dtype=dtype)
        self.hidden_norm = model_norm(cfg, d, dtype=dtype)
        fusion = init_weight(rngs, (2 * d, d), dtype, 2 * d)
        self.proj = nnx.Param(fusion, axes=(None, "embed"), matmul=MatmulAxes((0,)))  # [2D, D]: fused [e, h]
        self.block = LayerStack(cfg, cfg.mtp.block_layers, kind=cfg.mtp_layer_kind, dtype=dtype, rngs=rngs)
        self.final_norm = model_norm(cfg, d, dtype=dtype)
        self.hidden_first = cfg.mtp.concat_hidden_first
        embed = init_weight(rngs, (v, d), dtype, 1) if cfg.mtp.own_embedding else None
        head = init_weight(rngs, (d, v), dtype, d) if cfg.mtp.own_head else None
        self.embed = None if embed is None else nnx.Param(embed, axes=("vocab", "embed"), matmul=EMBEDDING)  # VD
        self.head = None if head is None else nnx.Param(head, axes=("embed", "vocab"), matmul=LM_HEAD)  # DV
        fused, width = bool(cfg.mtp.fused_layers), (len(cfg.mtp.fused_layers) + 1) * d  # fused features (`fuse`)
        features = init_weight(rngs, (width, d), dtype, width) if fused else None  # [(N+1) D, D]
        self.feature_norm = model_norm(cfg, d, dtype=dtype) if fused else None
        self.feature_proj = nnx.Param(features, axes=(None, "embed"), matmul=MatmulAxes((0,))) if fused else None

    def fuse(self, hidden: jax.Array, taps: jax.Array) -> jax.Array:
        """The hidden the MTP layer reads [B, T, D] from the trunk's final-normed hidden [B, T, D] and the outputs
        of its `fused_layers` [B, T, N, D] (EAGLE-3's fused features): [h, norm(l_1), .., norm(l_N)] projected."""
        normed = self.feature_norm(taps)
        features = jnp.concatenate([hidden, normed.reshape(*hidden.shape[:-1], -1)], axis=-1)  # [B, T, (N+1) D]
        return project("...F,FD->...D", features, self.feature_proj.get_value())

    def __call__(
        self,
        hidden: jax.Array,  # [B, T, D] trunk (or previous MTP) hidden at position p
        token_embeds: jax.Array,  # [B, T, D] embedding of the token at p + 1
        positions: jax.Array,  # [B, T]
        rope,
        cache,  # the MTP block's cache: KVCache [L, B, S, K, H] or LatentCache [L, B, S, C], L block layers
        visible_from: jax.Array | None = None,  # [B]: cache slots before it are not attended to
        block_mask: jax.Array | None = None,  # [B, T, T]: the block entries each position sees (None: causally)
    ) -> tuple[jax.Array, jax.Array, object]:
        e, h = self.token_norm(token_embeds), self.hidden_norm(hidden)
        fused = jnp.concatenate([h, e] if self.hidden_first else [e, h], axis=-1)  # [B, T, 2D]
        x = project("BTE,ED->BTD", fused, self.proj.get_value())
        x, cache = self.block(x, positions, rope, cache, visible_from=visible_from, block_mask=block_mask)
        return x, self.final_norm(x), cache


def _segment_stack(cfg: ModelConfig, segment: Segment, dtype, rngs) -> LayerStack | GroupStack:
    if segment.scanned_as_group:
        return GroupStack(cfg, segment.kinds, segment.count, dtype=dtype, rngs=rngs)
    return LayerStack(cfg, segment.count, kind=segment.kind, dtype=dtype, rngs=rngs)


class CausalLM(nnx.Module):
    """Decoder trunk (segments of layer stacks) + tied or untied lm_head + optional MTP module."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = nnx.Param(init_weight(rngs, (v, d), dtype, 1), axes=("vocab", "embed"), matmul=EMBEDDING)  # VD
        self.segments = nnx.List([_segment_stack(cfg, s, dtype, rngs) for s in cfg.segments()])
        self.final_norm = model_norm(cfg, d, dtype=dtype)
        head = None if cfg.tie_word_embeddings else init_weight(rngs, (d, v), dtype, d)
        self.lm_head = None if head is None else nnx.Param(head, axes=("embed", "vocab"), matmul=LM_HEAD)  # DV
        self.mtp = MtpModule(cfg, dtype=dtype, rngs=rngs) if cfg.has_mtp else None
        if cfg.has_mtp and cfg.mtp.draft_vocab_size:
            ids = jnp.arange(cfg.mtp.draft_vocab_size, dtype=jnp.int32)
            self.draft_vocab = nnx.Variable(ids, axes=(None,))  # [Vd]: a few thousand token ids, kept whole
        else:
            self.draft_vocab = None
        self.draft_table = nnx.data(None)  # `hold_draft_table`: the draft vocabulary's output rows, held once gathered
        self.sharding_rules = None  # mtp_jax.parallel.sharding.ShardingRules of a model placed on a mesh

    @property
    def dtype(self):
        return self.embed.dtype

    def new_cache(self, batch: int, slots: int, attention: AttentionForm | None = None):
        """An empty trunk cache in the model's dtype, per segment: KVCache [L, B, S, K, H] keys and values (GQA) or
        LatentCache [L, B, S, C] (MLA), or a GroupCache (hybrid layer groups: keys and values, DeltaNet states), one per
        segment in a tuple. `attention`: the attention caches' form
        (models/cache_attention.py: AttentionForm; None: `default_attention(slots)`)."""
        return tuple(segment.new_cache(batch, slots, self.dtype, attention) for segment in self.segments)

    def new_mtp_cache(self, batch: int, slots: int, attention: AttentionForm | None = None):
        """An empty MTP-block cache: KVCache [L, B, S, K, H] or LatentCache [L, B, S, C], L = `mtp.block_layers`."""
        return self.mtp.block.new_cache(batch, slots, self.dtype, attention)

    def rope(self, positions: jax.Array):
        cfg = self.config
        return rope_tables(positions, rope_inverse_frequencies(cfg.rope, cfg.rotary_dim), cfg.rope.attention_factor)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
        return constrain(take_rows(self.embed.get_value(), tokens), HIDDEN)

    def trunk(
        self,
        tokens: jax.Array,  # [B, T]
        positions: jax.Array,  # [B, T]
        cache,
        lengths: jax.Array | None = None,  # [B] valid tokens of right-padded rows (prefill); None: all T
        recurrent: RecurrentForm = RecurrentForm.CHUNKED,
        block_tree: BlockTree | None = None,  # a draft tree's block (decode/tree.py); None: a causal block
    ) -> tuple[jax.Array, object]:
        """Final-normed hidden [B, T, D] for tokens [B, T] at positions [B, T]; the cache gains their entries.

        Recurrent (gated DeltaNet) states, by the `recurrent` form (models/hybrid_stack.py): "chunked" (prefill)
        ends each row after its `lengths` tokens; "every_state" (a verify block) keeps what gives the state after
        any position until `keep_verified` picks one per row; "last_state" (a plain decode step) ends after the block.
        Attention caches ignore both (they roll back by length). With `block_tree`, each position attends to the
        cache before positions[:, 0] and to its ancestors in the block, whose entries go to slots positions[:, 0]
        onwards in block order (a tree's positions go by depth); recurrent layers take each entry's path
        ("every_state": `keep_verified` with the accepted path picks the states)."""
        hidden, _, cache = self._trunk(tokens, positions, cache, lengths, recurrent, block_tree, taps=())
        return hidden, cache

    def trunk_for_drafts(self, tokens, positions, cache, lengths=None, recurrent: RecurrentForm = RecurrentForm.CHUNKED,
                         block_tree: BlockTree | None = None) -> tuple[jax.Array, jax.Array, object]:  # fmt: skip
        """`trunk`, also giving the hidden the MTP layer pairs with the next token: (final-normed hidden [B, T, D],
        draft hidden [B, T, D], cache). The draft hidden is the final one, or with `mtp.fused_layers` its fusion
        with those layers' outputs (`MtpModule.fuse`): passes that feed no MTP layer call `trunk` and tap none."""
        fused = self.config.mtp.fused_layers if self.config.has_mtp else ()
        hidden, taps, cache = self._trunk(tokens, positions, cache, lengths, recurrent, block_tree, taps=fused)
        return hidden, (self.mtp.fuse(hidden, taps) if fused else hidden), cache

    def trunk_taps(self, tokens, positions, cache, taps: tuple[int, ...]) -> tuple[jax.Array, jax.Array | None]:
        """(final-normed hidden [B, T, D], the outputs of trunk layers `taps` [B, T, N, D] or None without taps) of a
        pass from `cache`: what a head with fused features trains on."""
        hidden, tapped, _ = self._trunk(tokens, positions, cache, None, RecurrentForm.CHUNKED, None, taps=taps)
        return hidden, tapped

    def _trunk(self, tokens, positions, cache, lengths, recurrent, block_tree, taps: tuple[int, ...]):
        """(final-normed hidden [B, T, D], the outputs of trunk layers `taps` [B, T, N, D] (None without), cache)."""
        with jax.named_scope("trunk"):
            x, rope = self.embed_tokens(tokens), self.rope(positions)
            updated, tapped = [], []
            for i, (spec, segment, segment_cache) in enumerate(
                zip(self.config.segments(), self.segments, cache, strict=True)
            ):
                with jax.named_scope(f"segment_{i}"):
                    if isinstance(segment, GroupStack):
                        tree = {} if block_tree is None else dict(block_tree=block_tree)
                        x, segment_cache = segment(x, positions, rope, segment_cache, lengths, recurrent, **tree)
                    else:
                        local = tuple(t - spec.start for t in taps if spec.start <= t < spec.start + spec.count)
                        mask = None if block_tree is None else block_tree.mask
                        x, segment_cache, outputs = segment.tapped(x, positions, rope, segment_cache, local,
                                                                   block_mask=mask)  # fmt: skip
                        if outputs is not None:
                            tapped.append(outputs)
                updated.append(segment_cache)
            taps_out = jnp.moveaxis(jnp.concatenate(tapped), 0, 2) if tapped else None  # [B, T, N, D]
            return self.final_norm(x), taps_out, tuple(updated)

    def keep_verified(self, before, after, accepted: jax.Array, active: jax.Array, path: jax.Array | None = None):
        """The trunk cache after a verify block run with recurrent="every_state": recurrent states as after block
        position accepted[b] ([B] int) of each row, rows not active ([B] bool) as `before`; attention caches as
        `after`. A draft tree's block: `path` [B, D+1], the accepted path's block entries by depth."""
        if not self.config.is_hybrid:
            return after
        return tuple(
            new.keep_verified(old, accepted, active, path).constrained() if isinstance(new, GroupCache) else new
            for old, new in zip(before, after, strict=True)
        )

    def head_weights(self) -> jax.Array:  # [D, V]
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]  # a quantized one dequantized

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] -> float32 logits [..., V]."""
        if self.lm_head is None:  # tied: the embedding [V, D] as stored
            logits = project("...D,VD->...V", hidden, self.embed.get_value(), jnp.float32)
        else:
            logits = project("...D,DV->...V", hidden, self.lm_head.get_value(), jnp.float32)
        return constrain(logits, LOGITS)

    def draft_head(self) -> jax.Array | None:
        """Rows [Vd, D] of the draft vocabulary's output weights (the MTP layer's own head, else the lm_head), for a
        decode loop to gather once rather than every draft step; None when drafts use the full vocabulary. On a
        mesh split over the vocabulary as the lm_head is, so each draft pass reads a chip's share of them."""
        if self.draft_vocab is None:
            return None
        if self.draft_table is not None:
            return self.draft_table.get_value()
        ids = self.draft_vocab[...]
        if self.mtp.head is not None:
            rows = take_columns(self.mtp.head.get_value(), ids)
        elif self.lm_head is None:
            rows = take_quantized_rows(self.embed.get_value(), ids)  # tied: the embedding's rows
        else:
            rows = take_columns(self.lm_head.get_value(), ids)
        return jax.tree.map(lambda a: constrain(a, DRAFT_HEAD), rows)  # a quantized head's values and scales alike

    def hold_draft_table(self, table) -> None:
        """Hold `table`, the rows [Vd, D] `draft_head()` gives in a layout their product reads (on a CPU: the row
        kernel's tiles), for `draft_head()` to return instead of gathering them on each call: a model whose output
        rows will not change (`loading.checkpoint.in_row_kernel_order`); a caller that updates the embedding or head
        in place sets `draft_table` back to None (stale rows would cost acceptance, never output: drafts are
        verified). A Variable, not a Param: neither trained nor saved."""
        self.draft_table = nnx.Variable(table)

    def draft_logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """Float32 MTP logits [..., Vd] over the draft vocabulary (all V ids when it has no subset). `head`: the
        rows [Vd, D] `draft_head()` gave, gathered once by the caller; without it they are gathered here."""
        head = self.draft_head() if head is None else head
        if head is not None:
            return project("...D,VD->...V", hidden, head, jnp.float32)
        if self.mtp is not None and self.mtp.head is not None:
            return project("...D,DV->...V", hidden, self.mtp.head.get_value(), jnp.float32)
        return self.logits(hidden)

    def draft_ids(self, draft_index: jax.Array) -> jax.Array:
        """Token ids for indices into the draft vocabulary."""
        return draft_index if self.draft_vocab is None else jnp.take(self.draft_vocab[...], draft_index)

    def mtp_step(
        self,
        hidden: jax.Array,  # [B, T, D]
        next_tokens: jax.Array,  # [B, T]
        positions: jax.Array,  # [B, T]
        cache,
        visible_from: jax.Array | None = None,  # [B]
        block_mask: jax.Array | None = None,  # [B, T, T]: a draft tree's (decode/tree.py); None: causal
    ) -> tuple[jax.Array, jax.Array, object]:
        """One MTP pass: (hidden to feed a deeper draft [B, T, D], normed hidden for logits [B, T, D], cache).
        With `visible_from`, the MTP layer attends to none of its cache slots before it (the cache of an adaptive
        loop that skipped the MTP layer over a stretch of positions)."""
        with jax.named_scope("mtp"):
            if self.mtp.embed is None:
                embeds = self.embed_tokens(next_tokens)
            else:
                embeds = constrain(take_rows(self.mtp.embed.get_value(), next_tokens), HIDDEN)
            rope = self.rope(positions)
            raw, normed, cache = self.mtp(hidden, embeds, positions, rope, cache, visible_from, block_mask)
            return (normed if self.config.mtp.recurse_normed else raw), normed, cache


def model_param_axes(cfg: ModelConfig, dtype) -> dict[tuple[str, ...], tuple[str | None, ...]]:
    """Every parameter's logical axes as its module declares them (`sharding.param_axes`), by state path, for the
    model of `cfg` (stacked layers), without allocating it."""
    return param_layouts(nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype)))


def model_param_matmuls(cfg: ModelConfig, dtype) -> dict[tuple[str, ...], MatmulAxes]:
    """Every matmul weight's `MatmulAxes` as its module declares them, over its whole array (`matmul_axes.param_matmul`:
    stacked layers batched), by state path, for the model of `cfg`, without allocating it; a parameter that declares
    none is absent."""
    return param_matmuls(nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype)))


def unstack_layers(model: CausalLM) -> CausalLM:
    """Give every layer of `model` (trunk and MTP block) parameter arrays of its own, in place; returns `model`.

    A scan over stacked layers slices each layer's weights out of the stack. Where the slice cannot be fused into
    the op that reads it, XLA copies the layer's weights at every step: on GPU before the cuBLAS matmuls, and on TPU
    before the routed experts' grouped matmul, a Mosaic kernel (measured, in docs/benchmarks-log.md: "Real sizes on a
    GPU" and "fp8 on TPU at full depth"). Unstacked, the layers are applied one by one (unrolled: longer compiles)
    and every op reads the weights where they lie. Outputs are the same either way. Needs about one more stack's
    worth of memory while it runs (each layer is copied out before the stack is freed).
    """
    for segment in model.segments:
        segment.unstack()
    if model.mtp is not None:
        model.mtp.block.unstack()
    return model


def preferred_layout(platform: str, quantized: bool = False) -> str:
    """The layout layers are best held in on `platform`: unstacked where a scan would copy layer weights every step
    (GPU, before its library matmuls; TPU with `quantized` weights, whose layer slice is copied out of the stack
    before the matmul that reads it in blocks), else stacked (one compiled layer body)."""
    return "unstacked" if platform == "gpu" or (platform == "tpu" and quantized) else "stacked"


def apply_layer_layout(model: CausalLM, layout: str = "auto", platform: str | None = None) -> CausalLM:
    """`model` with its layers held as `layout` says: "unstacked" (`unstack_layers`), "stacked" (as built), or "auto"
    (`preferred_layout` for `platform`, default: the default backend's)."""
    if layout not in LAYER_LAYOUTS:
        raise ValueError(f"layer layout {layout!r}: expected one of {', '.join(LAYER_LAYOUTS)}")
    if layout == "auto":
        layout = preferred_layout(platform or jax.default_backend(), is_quantized(model))
    return unstack_layers(model) if layout == "unstacked" else model


def hold_for_platform(model: CausalLM, layout: str = "auto", platform: str | None = None) -> CausalLM:
    """`model` held as decode runs it on `platform` (default: the default backend's): its layers as `layout` says
    (`apply_layer_layout`), and on a CPU its float8 weights as their bits (`quant.hold_float8_as_bits`)."""
    model = apply_layer_layout(model, layout, platform)
    return hold_float8_as_bits(model) if (platform or jax.default_backend()) == "cpu" else model
