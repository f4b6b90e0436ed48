"""Draft trees: a round that offers the trunk several guesses at each depth, in fixed shapes and lossless.

A tree of depth D (cfg.num_draft), width W (cfg.tree_width) and node budget N (cfg.tree), for a row whose pending
token x_n sits at position n (the root):
  1. draft: the MTP layer catches its cache up over the MTP block (as a chain's round does), and the root's draft
     distribution proposes its C = min(N, draft vocabulary) likeliest tokens, the depth-1 candidates (a child
     ranked past N among its siblings could never be among the N best). Each further depth expands the W best
     candidates of the depth before (by path probability: the product of the draft probabilities along the path),
     in one MTP pass over every expanded node so far (W, 2W, ... (D-1)W rows): a node at position n + its depth - 1,
     attending to the MTP cache before n and to its own ancestors (a block mask); the last W rows each propose their
     C likeliest children. Of the C + (D-1)WC candidates the N with the best path probability are kept (EAGLE-2's
     dynamic tree), the chain's D first: the path of each depth's likeliest draft, which a chain of D drafts would
     verify, is always expanded and kept, so a greedy tree accepts at least what that chain would, even where the
     head's probabilities are too flat to rank deep nodes above shallow ones. Any other child's path probability is
     at most its parent's, so a kept node's parent is kept too; the tree's shape is read off the parents either way.
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

Hybrid trunks (gated DeltaNet): in the verify pass each node's recurrent state is a chain's over its path from the
root (models/block_tree.py; a state per node in flight, one layer at a time); the block keeps its inputs, and once
the path is known each row's state is replayed over it, as after a chain's verify, and the path's attention entries
are written at consecutive slots (those layers' entries for the tree are not written first and moved).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mtp_jax.config import execution_plan
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.decode.loop_state import LoopState, round_keys
from mtp_jax.decode.rounds import Drafts, Round, RoundContext, Verdict, catch_up, commit, record, row_by_row_logits
from mtp_jax.decode.sampling import first_argmax, greedy_walk, probabilities, sample
from mtp_jax.kernels import traced_plan
from mtp_jax.models.block_tree import BlockTree, ancestry
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.hybrid_stack import RecurrentForm
from mtp_jax.models.kv_cache import GroupCache, move_slots


def check_tree_model(model: CausalLM, cfg: DecodeConfig) -> None:
    """Refuse a draft tree where its passes cannot run: more children than draft tokens,
    batch-invariant decoding without an attention kernel that takes the tree's mask (the CPU's; latent attention's
    batch-invariant form takes none)."""
    draft_vocab = draft_vocab_size(model)
    if cfg.tree_width > draft_vocab:
        raise ValueError(f"a tree {cfg.tree_width} wide proposes more children than the {draft_vocab} draft tokens")
    candidates = tree_children(model, cfg) * (1 + (cfg.num_draft - 1) * cfg.tree_width)
    if cfg.tree > candidates:
        raise ValueError(
            f"a tree of depth {cfg.num_draft} and width {cfg.tree_width} over {draft_vocab} draft tokens proposes "
            f"{candidates} nodes, fewer than its budget of {cfg.tree}"
        )
    if cfg.invariant and model.config.mla is not None:
        raise ValueError(
            "draft trees do not run under batch-invariant decoding with latent attention (its batch-invariant form "
            "takes no tree mask): decode with a chain"
        )
    plan = cfg.plan if cfg.plan is not None else traced_plan.resolve(model.sharding_rules, True)
    if cfg.invariant and not execution_plan.invariant_trees(plan):
        raise ValueError(
            "draft trees run under batch-invariant decoding (DecodeConfig.invariant, implied by 4-bit weights with "
            "int8 activations) only on one CPU device with the row kernel built (its attention takes the tree's "
            "mask): decode with a chain"
        )


def draft_vocab_size(model: CausalLM) -> int:
    """The tokens the MTP head drafts from (its draft vocabulary, or the whole vocabulary)."""
    return model.config.mtp.draft_vocab_size or model.config.vocab_size


def tree_children(model: CausalLM, cfg: DecodeConfig) -> int:
    """C, the children each expanded node proposes: N, or the whole draft vocabulary where it is smaller (a child
    ranked past N among its siblings is never among the N best)."""
    return min(cfg.tree, draft_vocab_size(model))


class DraftTree(NamedTuple):
    tokens: jax.Array  # [B, N] the nodes' tokens, parents before children
    parents: jax.Array  # [B, N] each node's parent in the verify block: 0 the root, i + 1 node i
    mtp_cache: object  # the MTP cache after the catch-up (and the expansions' entries past the pending position)


def _draft_log_probs(model, normed: jax.Array, head) -> jax.Array:
    """Float32 log draft probabilities [..., Vd] at the MTP layer's normed outputs [..., D]."""
    return jax.nn.log_softmax(model.draft_logits(normed, head), axis=-1)


def draft_tree(ctx: RoundContext, s: LoopState) -> DraftTree:
    """The N best nodes the MTP head proposes from each row's pending token (the module's step 1)."""
    model, cfg = ctx.model, ctx.cfg
    depth, width, budget = cfg.num_draft, cfg.tree_width, cfg.tree
    hidden, normed, mtp_cache = catch_up(ctx, s)  # [B, D]
    batch = hidden.shape[0]
    children = tree_children(model, cfg)
    scores, index = jax.lax.top_k(_draft_log_probs(model, normed, ctx.draft_head), children)  # [B, C]
    chain = jnp.broadcast_to(jnp.arange(children) == 0, (batch, children))  # [B, C] the first draft: the chain's
    tokens, all_scores, on_chain = [model.draft_ids(index)], [scores], [chain]  # per depth, the candidates'
    parent_ids = [jnp.full((batch, children), -1, jnp.int32)]  # the candidate ids of their parents
    frontier_ids, frontier_scores, frontier_chain = _best(scores, chain, width)  # [B, W] the depth-1 frontier
    rows_hidden = [jnp.broadcast_to(hidden[:, None], (batch, width, hidden.shape[-1]))]
    rows_tokens = [jnp.take_along_axis(tokens[0], frontier_ids, axis=1)]
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
        logq, index = jax.lax.top_k(_draft_log_probs(model, out_normed[:, -width:], ctx.draft_head), children)
        child_scores = (frontier_scores[:, :, None] + logq).reshape(batch, width * children)  # [B, W * C]
        child_chain = (frontier_chain[:, :, None] & (jnp.arange(children) == 0)).reshape(batch, width * children)
        child_tokens = model.draft_ids(index).reshape(batch, width * children)
        tokens.append(child_tokens)
        all_scores.append(child_scores)
        on_chain.append(child_chain)
        parent_ids.append(jnp.repeat(frontier_ids, children, axis=1))
        if level + 1 < depth:  # the next frontier: the W best children
            pick, frontier_scores, frontier_chain = _best(child_scores, child_chain, width)  # [B, W]
            frontier_ids = children + (level - 1) * width * children + pick  # this depth's first child's id + pick
            parent_row = pick // children  # [B, W] within the last W rows
            rows_hidden.append(jnp.take_along_axis(out_hidden[:, -width:], parent_row[..., None], axis=1))
            rows_tokens.append(jnp.take_along_axis(child_tokens, pick, axis=1))
            rows_parent.append((level - 1) * width + parent_row)
    joined = lambda parts: jnp.concatenate(parts, axis=1)
    return _kept(joined(tokens), joined(all_scores), joined(on_chain), joined(parent_ids), budget, mtp_cache)


def _best(scores: jax.Array, on_chain: jax.Array, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The `count` best of candidates [B, C] by path score, the chain's first (`on_chain`): (their indices, scores,
    and chain flags, [B, count] each)."""
    _, pick = jax.lax.top_k(jnp.where(on_chain, jnp.inf, scores), count)
    return pick, jnp.take_along_axis(scores, pick, axis=1), jnp.take_along_axis(on_chain, pick, axis=1)


def _kept(tokens, scores, on_chain, parent_ids, budget: int, mtp_cache) -> DraftTree:
    """The `budget` best candidates (tokens, scores, chain flags, parents' candidate ids [B, C], -1 for the root's
    children), the chain's D first, in candidate order, so parents come before their children; `top_k` prefers the
    lower id among equal keys. A kept node's parent is kept: the chain's parent is the chain's, and another's path
    score is at most its parent's."""
    kept, _, _ = _best(scores, on_chain, budget)
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
    block = BlockTree.of(parents, depth)
    hybrid = model.config.is_hybrid  # its recurrent layers keep the block's inputs until the path is known
    positions = s.position[:, None] + block.depths  # [B, N+1]
    recurrent = RecurrentForm.EVERY_STATE if hybrid else RecurrentForm.LAST_STATE
    hidden, draft_hidden, cache = model.trunk_for_drafts(inputs, positions, s.cache, recurrent=recurrent,
                                                         block_tree=block)  # fmt: skip
    if ctx.sampling is None and row_by_row_logits(ctx.cfg, batch, budget):
        accepted, token, end = greedy_walk(tree.tokens, block.parents[:, 1:], hidden, model.logits)
        path = jnp.take_along_axis(block.paths, end[:, None, None], axis=1)[:, 0]  # [B, D+1]
    else:
        logits = model.logits(hidden)  # [B, N+1, V]
        if ctx.sampling is None:
            picks = first_argmax(logits)  # [B, N+1]
        else:
            keys = jax.vmap(lambda key: jax.random.split(key, budget + 1))(round_keys(s.row_keys, s.num_generated, 1))
            picks = jax.vmap(jax.vmap(sample))(keys, probabilities(logits, ctx.sampling))  # [B, N+1]
        accepted, token, path = accepted_path(tree.tokens, block, picks)
    if hybrid:  # states after the path, its attention entries written in place (`commit` finds nothing to keep)
        cache = model.keep_verified(s.cache, cache, accepted, ~s.done, path)
    moved = lambda segment: (
        segment if isinstance(segment, GroupCache) else move_slots(segment, s.position, path, budget + 1)
    )
    cache = tuple(moved(segment) for segment in cache)
    path_hidden = jnp.take_along_axis(draft_hidden, path[..., None], axis=1)  # [B, D+1, D]
    verdict = Verdict(accepted, token, path_hidden, cache, None)
    return TreeVerdict(verdict, jnp.take_along_axis(inputs, path[:, 1:], axis=1))


def accepted_path(tokens: jax.Array, block: BlockTree, picks: jax.Array):
    """The accepted path of a verified tree (the module's step 3): tokens [B, N] of the nodes, `block` the verify
    block's structure (the root, entry 0, then the nodes), picks [B, N+1] the target's token at each entry. Returns
    (the path's depth a [B], the target's token at its end [B], the path's block entries by depth [B, D+1], its last
    entry again past its end)."""
    parents = block.parents[:, 1:]  # [B, N]
    matches = tokens == jnp.take_along_axis(picks, parents, axis=1)  # [B, N] each node is its parent's pick
    on_path = jnp.ones(picks.shape, bool)
    for _ in range(block.depth):
        on_path = jnp.concatenate([on_path[:, :1], matches & jnp.take_along_axis(on_path, parents, 1)], 1)
    end = jnp.argmax(jnp.where(on_path, block.depths, -1), axis=1)  # [B] the deepest entry on the path
    accepted = jnp.take_along_axis(block.depths, end[:, None], axis=1)[:, 0]
    token = jnp.take_along_axis(picks, end[:, None], axis=1)[:, 0]
    return accepted, token, jnp.take_along_axis(block.paths, end[:, None, None], axis=1)[:, 0]


def run_tree_round(ctx: RoundContext, round_: Round, s: LoopState) -> LoopState:
    """One round with a draft tree (a `lax.while_loop` body once `ctx` and `round_` are bound)."""
    tree = draft_tree(ctx, s)
    verdict, path_tokens = verify_tree(ctx, s, tree)
    drafts = Drafts(path_tokens, None, None, None, tree.mtp_cache)
    state = commit(ctx, round_, s, drafts, verdict)
    return record(ctx, round_, s, state, drafts, verdict)
