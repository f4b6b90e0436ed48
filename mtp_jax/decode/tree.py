"""Draft trees: a round that offers the trunk several guesses at each depth, in fixed shapes and lossless.

A tree of depth D (cfg.num_draft), width W (cfg.tree_width) and node budget N (cfg.tree), for a row whose pending
token x_n sits at position n (the root):
  1. draft: the MTP layer catches its cache up over the MTP block (as a chain's round does), and the root's draft
     distribution proposes its W likeliest tokens, the depth-1 candidates. Each further depth expands the W best
     candidates of the depth before (by path probability: the product of the draft probabilities along the path),
     in one MTP pass over every expanded node so far (W, 2W, ... (D-1)W rows): a node at position n + its depth - 1,
     attending to the MTP cache before n and to its own ancestors (a block mask); the last W rows each propose their
     W likeliest children. Of the W + (D-1)W^2 candidates the N with the best path probability are kept (EAGLE-2's
     dynamic tree). A child's path probability is at most its parent's, so a kept node's parent is kept too; the
     tree's shape is read off the parents either way.
  2. verify: the trunk runs the root and the N nodes (parents before children) in one pass: node i at position
     n + its depth, writing cache slot n + i, attending to the cache before n and to its ancestors.
  3. accept: at every node the target picks a token (greedy: its argmax; sampling: one draw from its distribution,
     a fresh key per node). A node is on the accepted path when its token is the one its parent's target picked and
     its parent is on the path; the deepest such node ends it, and the target's token there follows. Greedy, that is
     the chain's rule over every branch at once. Sampling, the walk from the root draws each next token from the
     target's distribution given the path so far and follows a child only where the draw equals it, so every emitted
     token is the target's own draw: the output distribution is the target's exactly, whatever the tree.
  4. commit: the path's trunk cache entries move from slots n + i to n + their depth (a gather of D + 1 entries per
     row and layer); its hiddens and emitted tokens become the next MTP block; the rest is rolled back by length.

Recurrent trunks (gated DeltaNet) decode chains: a tree's verify pass would carry a state per node.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.loop_state import LoopState, round_keys
from mtp_jax.decode.rounds import Drafts, Round, RoundContext, Verdict, catch_up, commit, record
from mtp_jax.decode.sampling import probabilities, sample
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.kv_cache import move_slots
from mtp_jax.ops import dispatch


def check_tree_model(model: CausalLM, cfg: DecodeConfig) -> None:
    """Refuse a draft tree where its passes cannot run: a recurrent trunk, more children than draft tokens,
    batch-invariant decoding without an attention kernel that takes the tree's mask (the CPU's; latent attention's
    batch-invariant form takes none)."""
    if model.config.is_hybrid:
        raise ValueError(
            "draft trees need an attention-only trunk: a gated DeltaNet trunk's verify pass would carry a state per "
            "node; decode it with a chain (num_draft without tree)"
        )
    draft_vocab = model.config.mtp.draft_vocab_size or model.config.vocab_size
    if cfg.tree_width > draft_vocab:
        raise ValueError(f"a tree {cfg.tree_width} wide proposes more children than the {draft_vocab} draft tokens")
    if cfg.invariant and model.config.mla is not None:
        raise ValueError(
            "draft trees do not run under batch-invariant decoding with latent attention (its batch-invariant form "
            "takes no tree mask): decode with a chain"
        )
    if cfg.invariant and not dispatch.invariant_trees_here():
        raise ValueError(
            "draft trees run under batch-invariant decoding (DecodeConfig.invariant, implied by 4-bit weights with "
            "int8 activations) only on one CPU device with the row kernel built (its attention takes the tree's "
            "mask): decode with a chain"
        )


class DraftTree(NamedTuple):
    tokens: jax.Array  # [B, N] the nodes' tokens, parents before children
    parents: jax.Array  # [B, N] each node's parent in the verify block: 0 the root, i + 1 node i
    mtp_cache: object  # the MTP cache after the catch-up (and the expansions' entries past the pending position)


def ancestry(parents: jax.Array, depth: int) -> jax.Array:
    """[B, T, T] bool: whether block entry j is entry i or one of its ancestors, for a block whose entry i has the
    parent parents[b, i] (< i; an entry without one names itself) and no path deeper than `depth`."""
    t = parents.shape[-1]
    own = jnp.broadcast_to(jnp.eye(t, dtype=bool), (*parents.shape, t))
    seen = own
    for _ in range(depth):
        seen = own | jnp.take_along_axis(seen, parents[..., None], axis=1)
    return seen


def block_depths(parents: jax.Array, depth: int) -> jax.Array:
    """[B, T] int32: each entry's depth below the block's first (the root, its own parent)."""
    depths = jnp.zeros(parents.shape, jnp.int32)
    is_root = parents == jnp.arange(parents.shape[-1])
    for _ in range(depth):
        depths = jnp.where(is_root, 0, jnp.take_along_axis(depths, parents, axis=1) + 1)
    return depths


def _draft_log_probs(model, normed: jax.Array, head) -> jax.Array:
    """Float32 log draft probabilities [..., Vd] at the MTP layer's normed outputs [..., D]."""
    return jax.nn.log_softmax(model.draft_logits(normed, head), axis=-1)


def draft_tree(ctx: RoundContext, s: LoopState) -> DraftTree:
    """The N best nodes the MTP head proposes from each row's pending token (the module's step 1)."""
    model, cfg = ctx.model, ctx.cfg
    depth, width, budget = cfg.num_draft, cfg.tree_width, cfg.tree
    hidden, normed, mtp_cache = catch_up(ctx, s)  # [B, D]
    batch = hidden.shape[0]
    scores, index = jax.lax.top_k(_draft_log_probs(model, normed, ctx.draft_head), width)  # [B, W]
    tokens = [model.draft_ids(index)]  # per depth: the candidates' tokens
    all_scores, parent_ids = [scores], [jnp.full((batch, width), -1, jnp.int32)]  # candidate ids of the parents
    frontier_ids, frontier_scores = jnp.broadcast_to(jnp.arange(width), (batch, width)), scores
    rows_hidden, rows_tokens = [jnp.broadcast_to(hidden[:, None], (batch, width, hidden.shape[-1]))], [tokens[0]]
    rows_parent = [jnp.broadcast_to(jnp.arange(width), (batch, width))]  # depth-1 rows: no parent in the block
    for level in range(1, depth):  # expand the depth-`level` frontier
        parent_rows = jnp.concatenate(rows_parent, axis=1)  # [B, level * W]
        positions = s.position[:, None] + jnp.repeat(jnp.arange(level), width)  # [B, level * W]
        out_hidden, out_normed, mtp_cache = model.mtp_step(
            jnp.concatenate(rows_hidden, axis=1),
            jnp.concatenate(rows_tokens, axis=1),
            positions,
            mtp_cache,
            s.block.visible_from,
            ancestry(parent_rows, level),
        )
        logq, index = jax.lax.top_k(_draft_log_probs(model, out_normed[:, -width:], ctx.draft_head), width)  # [B, W, W]
        child_scores = (frontier_scores[:, :, None] + logq).reshape(batch, width * width)
        child_tokens = model.draft_ids(index).reshape(batch, width * width)
        tokens.append(child_tokens)
        all_scores.append(child_scores)
        parent_ids.append(jnp.repeat(frontier_ids, width, axis=1))
        if level + 1 < depth:  # the next frontier: the W best children
            frontier_scores, pick = jax.lax.top_k(child_scores, width)  # [B, W]
            first_id = width + (level - 1) * width * width  # the candidate id of this depth's first child
            frontier_ids = first_id + pick
            parent_row = pick // width  # [B, W] within the last W rows
            rows_hidden.append(jnp.take_along_axis(out_hidden[:, -width:], parent_row[..., None], axis=1))
            rows_tokens.append(jnp.take_along_axis(child_tokens, pick, axis=1))
            rows_parent.append((level - 1) * width + parent_row)
    return _kept(jnp.concatenate(tokens, 1), jnp.concatenate(all_scores, 1), jnp.concatenate(parent_ids, 1), budget,
                 mtp_cache)  # fmt: skip


def _kept(tokens, scores, parent_ids, budget: int, mtp_cache) -> DraftTree:
    """The `budget` best candidates (tokens, scores, parents' candidate ids [B, C], -1 for the root's children) in
    candidate order, so parents come before their children; `top_k` prefers the lower id among equal scores."""
    _, kept = jax.lax.top_k(scores, budget)
    kept = jnp.sort(kept, axis=-1)  # [B, N]
    batch = kept.shape[0]
    node_of = jnp.full(scores.shape, -1, jnp.int32).at[jnp.arange(batch)[:, None], kept].set(jnp.arange(budget))
    parent_id = jnp.take_along_axis(parent_ids, kept, axis=1)
    parent_node = jnp.take_along_axis(node_of, jnp.maximum(parent_id, 0), axis=1)
    parents = jnp.where((parent_id < 0) | (parent_node < 0), 0, parent_node + 1)  # block entries, 0 the root
    return DraftTree(jnp.take_along_axis(tokens, kept, axis=1), parents, mtp_cache)


class TreeVerdict(NamedTuple):
    verdict: Verdict  # accepted: the path's depth; hidden: the path's trunk hiddens [B, D+1, D]
    path_tokens: jax.Array  # [B, D] the path's drafts (valid up to the accepted depth)


def verify_tree(ctx: RoundContext, s: LoopState, tree: DraftTree) -> TreeVerdict:
    """The trunk over the root and the tree's nodes in one pass, the accepted path, and the cache with the path's
    entries moved to consecutive slots (the module's steps 2 and 3 and the cache's part of 4)."""
    model, depth = ctx.model, ctx.cfg.num_draft
    batch, budget = tree.tokens.shape
    inputs = jnp.concatenate([s.pending[:, None], tree.tokens], axis=1)  # [B, N+1]
    parents = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tree.parents], axis=1)  # [B, N+1]
    depths, visible = block_depths(parents, depth), ancestry(parents, depth)  # [B, N+1], [B, N+1, N+1]
    hidden, cache = model.trunk(inputs, s.position[:, None] + depths, s.cache, recurrent="last_state",
                                block_mask=visible)  # fmt: skip
    logits = model.logits(hidden)  # [B, N+1, V]
    if ctx.sampling is None:
        picks = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N+1]
    else:
        keys = jax.vmap(lambda key: jax.random.split(key, budget + 1))(round_keys(s.row_keys, s.num_generated, 1))
        picks = jax.vmap(jax.vmap(sample))(keys, probabilities(logits, ctx.sampling))  # [B, N+1]
    accepted, token, path = accepted_path(tree.tokens, parents, picks, depth)
    cache = tuple(move_slots(segment, s.position, path, budget + 1) for segment in cache)
    path_hidden = jnp.take_along_axis(hidden, path[..., None], axis=1)  # [B, D+1, D]
    verdict = Verdict(accepted, token, path_hidden, cache, None)
    return TreeVerdict(verdict, jnp.take_along_axis(inputs, path[:, 1:], axis=1))


def accepted_path(tokens: jax.Array, parents: jax.Array, picks: jax.Array, depth: int):
    """The accepted path of a verified tree (the module's step 3): tokens [B, N] of the nodes, parents [B, N+1] of
    the block's entries (the root, entry 0, its own), picks [B, N+1] the target's token at each entry, `depth` the
    tree's. Returns (the path's depth a [B], the target's token at its end [B], the path's block entries by depth
    [B, D+1], 0 past its end)."""
    batch = tokens.shape[0]
    matches = tokens == jnp.take_along_axis(picks, parents[:, 1:], axis=1)  # [B, N] each node is its parent's pick
    on_path = jnp.ones((batch, tokens.shape[1] + 1), bool)
    for _ in range(depth):
        on_path = jnp.concatenate([on_path[:, :1], matches & jnp.take_along_axis(on_path, parents[:, 1:], 1)], 1)
    depths = block_depths(parents, depth)  # [B, N+1]
    end = jnp.argmax(jnp.where(on_path, depths, -1), axis=1)  # [B] the deepest entry on the path
    accepted = jnp.take_along_axis(depths, end[:, None], axis=1)[:, 0]
    token = jnp.take_along_axis(picks, end[:, None], axis=1)[:, 0]
    lineage = jnp.take_along_axis(ancestry(parents, depth), end[:, None, None], axis=1)[:, 0]  # [B, N+1]
    at_depth = lineage[:, None, :] & (depths[:, None, :] == jnp.arange(depth + 1)[None, :, None])  # [B, D+1, N+1]
    return accepted, token, jnp.argmax(at_depth, axis=-1)


def run_tree_round(ctx: RoundContext, round_: Round, s: LoopState) -> LoopState:
    """One round with a draft tree (a `lax.while_loop` body once `ctx` and `round_` are bound)."""
    tree = draft_tree(ctx, s)
    verdict, path_tokens = verify_tree(ctx, s, tree)
    drafts = Drafts(path_tokens, None, None, None, tree.mtp_cache)
    state = commit(ctx, round_, s, drafts, verdict)
    return record(ctx, round_, s, state, drafts, verdict)
