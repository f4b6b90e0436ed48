"""Hybrid trunks (Qwen3-Next, Qwen3.5 / 3.6): a layer group (e.g. 3 gated DeltaNet layers then 1 gated attention
layer) repeated R times, with the parameters of each layer of the group stacked over the repeats and one
`lax.scan` over the repeats, so a 48- or 64-layer trunk compiles one group body.

A DeltaNet layer runs in one of three forms (`RecurrentForm`), chosen by the caller of the trunk:
  "chunked" (prefill; chunked delta rule): each row's state after its own last valid token (`lengths`);
  "every_state" (verify; recurrent): what gives the state after any block position (`VerifiedBlock`), for
                `GroupCache.keep_verified`;
  "last_state" (plain decode step; recurrent): the state after the block's last token, written back at once.
Attention layers write their keys and values at their positions as in models/causal_lm.py's LayerStack.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config.model import LayerKind, ModelConfig
from mtp_jax.kernels import traced_plan
from mtp_jax.models.blocks import ATTENTION_BLOCKS, MLP_BLOCKS
from mtp_jax.models.cache_attention import AttentionForm, checked_attention, layer_entries
from mtp_jax.models.gated_deltanet import DeltaNetState, GatedDeltaNet
from mtp_jax.models.kv_cache import GroupCache, KVCache, TreeEntries, deltanet_states, write_slots
from mtp_jax.models.layers import DecoderLayer, model_norm
from mtp_jax.ops import loops
from mtp_jax.ops.stacked_weights import layer_parameters, split_stack, stack_split_of
from mtp_jax.parallel.sharding import HIDDEN, constrain


class RecurrentForm(enum.Enum):
    """What a DeltaNet layer's pass keeps of its state (module docstring)."""

    CHUNKED = "chunked"
    EVERY_STATE = "every_state"
    LAST_STATE = "last_state"


class DeltaNetLayer(nnx.Module):
    """Pre-norm residual block with a gated DeltaNet token mixer: x + deltanet(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None, mlp):
        self.input_norm = model_norm(cfg, cfg.hidden_size, dtype=dtype)
        self.attn = GatedDeltaNet(cfg.linear_attention, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.post_attention_norm = model_norm(cfg, cfg.hidden_size, dtype=dtype)
        self.mlp = mlp(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, state: DeltaNetState, lengths, recurrent: RecurrentForm, invariant: bool = False, tree=None):
        """x [B, T, D] -> (x, the state `recurrent` names: after each row's `lengths` tokens ("chunked"), what
        gives the state after any position ("every_state": a VerifiedBlock), after the last position
        ("last_state")). `invariant`: the MLP's batch-invariant form (the delta rule's sums are each row's own in
        every form). `tree`: a draft tree's block (a BlockTree; "every_state")."""
        x = constrain(x, HIDDEN)
        normed = self.input_norm(x)
        with jax.named_scope("attention"):
            if recurrent == RecurrentForm.CHUNKED:
                out, state = self.attn.prefill(normed, state, lengths)
            else:
                out, state = self.attn.verify(
                    normed, state, every_position=recurrent == RecurrentForm.EVERY_STATE, tree=tree
                )
        x = x + constrain(out, HIDDEN)
        with jax.named_scope("mlp"):
            x = x + constrain(self.mlp(self.post_attention_norm(x), invariant=invariant), HIDDEN)
        return x, state


def _stacked(make, count: int, rngs: nnx.Rngs | None):
    """`count` modules from `make(rngs)` with their parameters stacked on a leading axis."""
    if rngs is None:
        return nnx.vmap(lambda _: make(None), in_axes=0, out_axes=0)(jax.numpy.arange(count))

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(layer_rngs):
        return make(layer_rngs)

    return build(rngs)


def _make_layer(cfg: ModelConfig, kind: LayerKind, dtype):
    mlp = MLP_BLOCKS[kind.mlp]
    if kind.attention == "deltanet":
        return lambda rngs: DeltaNetLayer(cfg, dtype=dtype, rngs=rngs, mlp=mlp)
    if kind.attention != "gated":
        raise ValueError(f"a hybrid layer group holds gated DeltaNet and gated attention layers, not {kind.attention}")
    return lambda rngs: DecoderLayer(cfg, dtype=dtype, rngs=rngs, attention=ATTENTION_BLOCKS["gated"], mlp=mlp)


class GroupStack(nnx.Module):
    """`repeats` repeats of a group of layers (`kinds`, one per layer); `members[j]` is layer j of the group with
    parameters stacked over the repeats (leading axis R)."""

    def __init__(self, cfg: ModelConfig, kinds: tuple[LayerKind, ...], repeats: int, *, dtype, rngs: nnx.Rngs | None):
        self.config, self.kinds, self.repeats = cfg, kinds, repeats
        self.members = nnx.List([_stacked(_make_layer(cfg, kind, dtype), repeats, rngs) for kind in kinds])

    def unstack(self) -> None:
        """Hold each repeat's parameters as arrays of their own (`unstack_layers`): members[j][r]."""
        if not isinstance(self.members[0], nnx.List):
            self.members = nnx.List(
                [nnx.List(loops.unstacked_modules(member, self.repeats)) for member in self.members]
            )

    def new_cache(self, batch: int, slots: int, dtype, attention: AttentionForm | None = None) -> GroupCache:
        """Empty caches: KVCache [R, B, S, K, H] per attention layer (attended in form `attention`), zero
        DeltaNetStates [R, B, ...] per DeltaNet."""
        attention = checked_attention(attention, slots)
        members = tuple(
            deltanet_states(self.repeats, batch, self.config, dtype)
            if kind.attention == "deltanet"
            else KVCache.zeros(self.repeats, batch, slots, self.config, dtype, attention)
            for kind in self.kinds
        )
        return GroupCache(members=members, attention=attention).constrained()

    def __call__(
        self,
        x,
        positions,
        rope,
        cache: GroupCache,
        lengths=None,
        recurrent: RecurrentForm = RecurrentForm.CHUNKED,
        block_tree=None,
    ):
        """x [B, T, D] through every repeat of the group; returns (x, the cache after these tokens: attention entries
        written at slots positions[:, 0] onwards, DeltaNet states as the `recurrent` form gives them). A draft
        tree's block (`block_tree`, a BlockTree: positions go by depth) takes the "every_state" form, its attention
        entries held apart (TreeEntries) until `GroupCache.keep_verified` writes the accepted path's."""
        if not isinstance(recurrent, RecurrentForm):
            raise ValueError(f"recurrent form {recurrent!r}: expected a RecurrentForm")
        if block_tree is not None and recurrent != RecurrentForm.EVERY_STATE:
            raise ValueError(f"a draft tree's block keeps what gives every entry's state, not {recurrent!r}")
        block_mask = None if block_tree is None else block_tree.mask
        past = cache.constrained().members
        attention = cache.attention
        # DeltaNet states are scanned over (each repeat reads its whole state); attention caches are read in place.
        deltanet = [kind.attention == "deltanet" for kind in self.kinds]
        states = tuple(entry if is_deltanet else None for is_deltanet, entry in zip(deltanet, past, strict=True))

        def run(layers, x, repeat_states, repeat):
            new = []
            for j, (kind, layer) in enumerate(zip(self.kinds, layers, strict=True)):
                with jax.named_scope(f"layer_{j}"):
                    if kind.attention == "deltanet":
                        x, state = layer(
                            x, repeat_states[j], lengths, recurrent, attention == AttentionForm.INVARIANT, block_tree
                        )
                        new.append(state)
                    else:
                        keys, values = layer_entries(past[j].k, repeat), layer_entries(past[j].v, repeat)
                        x, k, v = layer(x, positions, rope, keys, values, attention=attention, block_mask=block_mask)
                        new.append((k, v))
            return x, tuple(new)

        if isinstance(self.members[0], nnx.List):  # unstacked (`unstack_layers`): members[j][r]
            repeats = [
                (tuple(member[r] for member in self.members), jax.tree.map(lambda a, r=r: a[r], states))
                for r in range(self.repeats)
            ]
            x, new = loops.each_layer(lambda inputs, x, r: run(inputs[0], x, inputs[1], r), x, repeats)
        else:
            split = [nnx.split(member) for member in self.members]  # each leaf [R, ...]
            graphdefs, stacked = [g for g, _ in split], tuple(p for _, p in split)
            merged = lambda params: tuple(nnx.merge(g, p) for g, p in zip(graphdefs, params, strict=True))
            keep, experts_only = stack_split_of(traced_plan.current())
            whole, sliced = split_stack(stacked, experts_only) if keep else (None, stacked)
            step = lambda x, inputs: run(merged(layer_parameters(whole, inputs[0], inputs[2])), x, *inputs[1:])
            x, new = loops.scan(step, x, (sliced, states, jnp.arange(self.repeats)))
        # new: DeltaNet states [R, B, ...]; attention entries [R, B, T, K, H]
        members = []
        for kind, old, entry in zip(self.kinds, past, new, strict=True):
            if kind.attention == "deltanet":
                members.append(entry)
            elif block_tree is not None:  # written along the accepted path by `GroupCache.keep_verified`
                members.append(TreeEntries(k=entry[0], v=entry[1], start=positions[:, 0]))
            else:
                k, v = entry
                members.append(old.replace(k=write_slots(old.k, k, positions), v=write_slots(old.v, v, positions)))
        updated = GroupCache(members=tuple(members), attention=cache.attention)
        return x, (updated if recurrent == RecurrentForm.EVERY_STATE else updated.constrained())
