"""Adaptive draft length: before each round, pick j in 0..k drafts from the running acceptance and the cost of a
round with j drafts, so drafting stops where it does not pay (large batches, a head that does not fit the text).

With conditional acceptance a_i at depth i, a round with j drafts emits E(j) = 1 + a_0 + a_0 a_1 + ... tokens on
average (the bonus included) and costs c(j) plain steps; the policy picks argmax E(j) / c(j). When no j >= 1 pays,
the loop rests: plain steps that skip the MTP layer (their hiddens queue in the MTP block), with a probe through the
MTP layer once the block is full, so a head that does not pay costs a fraction of the MTP layer, not all of it.
Any round keeps the output exact (each is a complete speculative step), so the choice only moves speed.

With a draft tree (DecodeConfig.tree), a tree round of depth k is one more choice: its conditional acceptance per
depth is tracked apart from the chain's (the tree offers several guesses a depth), its cost is the last entry of
the round costs, and it is taken where its expected tokens per unit of time are the best.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

PRIOR_RATE = 0.5  # acceptance at depth 0 assumed before any evidence ...
PRIOR_WEIGHT = 2.0  # ... worth this many judged drafts
DECAY = 0.9  # per measured round: recent rounds count more, so the choice follows the text
MARGIN = 0.05  # drafting must beat resting by this fraction: near break-even it gains nothing on average, while
# the noise of a running estimate (one row judges one draft per depth a round) makes its wrong calls cost
REST_ROUNDS = 12  # the MTP block of an adaptive loop holds this many slots more than k + 1, for rests
LONGEST_REST = 256  # the most rests that slide the MTP block between two probes (RestSchedule)
TREE_GUESSES = 2  # before a tree is measured, it is taken to offer this many independent guesses of the chain's
# acceptance at each depth: optimistic (measured, N = 16: 0.44 -> 0.61 at depth 1, where two guesses give 0.69), so
# a tree that might pay gets tried; its own counts then take over


def probe_cycle(max_draft: int) -> int:
    """Rounds from one probe to the next while resting: a probe leaves one slot of the MTP block (width k + 1 +
    REST_ROUNDS) filled, and rests fill the rest of it."""
    return max_draft + 1 + REST_ROUNDS


@struct.dataclass
class AcceptanceTracker:
    """Decayed counts per depth over active rows, of chain rounds and of tree rounds apart. hits [k]: drafts (a
    tree's: path nodes) accepted; trials [k]: judged."""

    hits: jax.Array
    trials: jax.Array
    tree_hits: jax.Array
    tree_trials: jax.Array

    @classmethod
    def start(cls, max_draft: int) -> AcceptanceTracker:
        zeros = jnp.zeros((max_draft,), jnp.float32)
        return cls(hits=zeros, trials=zeros, tree_hits=zeros, tree_trials=zeros)

    def rates(self) -> jax.Array:
        """Estimated conditional acceptance of a chain per depth [k]. Each depth's prior is the estimate of the
        depth before it (conditional acceptance rarely falls with depth), so a depth not drafted yet looks as good
        as the last one measured and gets tried, instead of staying at a pessimistic prior forever."""
        rates, prior = [], jnp.float32(PRIOR_RATE)
        for depth in range(self.hits.shape[0]):
            prior = (self.hits[depth] + prior * PRIOR_WEIGHT) / (self.trials[depth] + PRIOR_WEIGHT)
            rates.append(prior)
        return jnp.stack(rates)

    def tree_rates(self) -> jax.Array:
        """Estimated conditional acceptance of a tree per depth [k]: its own counts, over a prior of TREE_GUESSES
        guesses at the chain's current rate (so an unmeasured tree, or one not run for a while, moves with the
        chain's estimate)."""
        prior = 1.0 - (1.0 - self.rates()) ** TREE_GUESSES
        return (self.tree_hits + prior * PRIOR_WEIGHT) / (self.tree_trials + PRIOR_WEIGHT)

    def update(self, hits: jax.Array, trials: jax.Array, tree: bool = False) -> AcceptanceTracker:
        """Add a round's counts [k] (a tree round's with `tree`); depths not judged keep their estimate (both
        counts decay)."""
        if tree:
            return self.replace(tree_hits=DECAY * self.tree_hits + hits, tree_trials=DECAY * self.tree_trials + trials)
        return self.replace(hits=DECAY * self.hits + hits, trials=DECAY * self.trials + trials)


@struct.dataclass
class RestSchedule:
    """When a resting loop probes next. While the MTP block has room, rests queue their hiddens and tokens in it;
    once it is full, the probe comes after `allowance` more rests, each of which slides the block: its oldest entry
    is dropped, so the MTP layer never runs over that position, and from then on attends to its cache only from the
    block's start (a shorter context, which can cost acceptance but never exactness). The allowance grows with each
    probe (to the block's width, then doubling, up to LONGEST_REST) and is 0 again after a drafting round, so a
    head that keeps not paying is probed ever more rarely and costs ever less of the MTP layer's upkeep.

    slides: int32 [] rests that slid the block since the last probe or drafting round; allowance: int32 []."""

    slides: jax.Array
    allowance: jax.Array

    @classmethod
    def start(cls) -> RestSchedule:
        return cls(slides=jnp.int32(0), allowance=jnp.int32(0))

    def may_rest(self, block_has_room: jax.Array) -> jax.Array:
        return block_has_room | (self.slides < self.allowance)

    def after_probe(self, block_width: int) -> RestSchedule:
        grown = jnp.clip(2 * self.allowance, block_width, LONGEST_REST)
        return RestSchedule(slides=jnp.int32(0), allowance=grown.astype(jnp.int32))

    def after_draft(self) -> RestSchedule:
        return RestSchedule.start()

    def after_rest(self, slid: jax.Array) -> RestSchedule:
        return RestSchedule(slides=self.slides + slid.astype(jnp.int32), allowance=self.allowance)


def expected_tokens(rates: jax.Array) -> jax.Array:
    """Tokens a round emits on average with j = 0..k drafts: [k+1]."""
    reach = jnp.concatenate([jnp.ones((1,), rates.dtype), jnp.cumprod(rates)])  # P(draft j is judged), bonus last
    return jnp.cumsum(reach)


def choose_round(tracker: AcceptanceTracker, round_costs: jax.Array, can_rest: jax.Array) -> jax.Array:
    """The next round, int32 [] in 0..R (k = the most drafts; R = k + 1, or k + 2 with a tree round, whose cost is
    round_costs[k + 1]): j in 1..k drafts, or k + 1 a tree, when that gives the most tokens per unit of time and
    beats resting by MARGIN; otherwise R, a rest (a plain step that leaves the MTP layer alone), while `can_rest`
    (the MTP block has room, or RestSchedule allows sliding it), and 0 when not: a probe, a plain step that runs the
    MTP layer over the rested tokens and scores its first draft, which keeps the acceptance estimate current.

    A rest costs one plain step and a probe round_costs[0] (>= 1); resting is valued at one probe per
    `probe_cycle` rounds, its dearest (RestSchedule probes more rarely as resting goes on)."""
    max_draft = tracker.hits.shape[0]
    tokens = expected_tokens(tracker.rates())  # [k+1]
    if round_costs.shape[0] > max_draft + 1:  # a tree of depth k
        tokens = jnp.concatenate([tokens, expected_tokens(tracker.tree_rates())[-1:]])
    value = tokens / round_costs  # [R] tokens per plain step of time
    best = jnp.argmax(value[1:]) + 1
    resting = rest_value(round_costs[0], max_draft)
    drafting_pays = value[best] > resting * (1.0 + MARGIN)
    rest = round_costs.shape[0]
    return jnp.where(drafting_pays, best, jnp.where(can_rest, rest, 0)).astype(jnp.int32)


def rest_value(probe_cost, max_draft: int):
    """Tokens per plain step of resting: a cycle of C = probe_cycle(k) rounds, C - 1 rests and a probe of cost c_0,
    gives 1 / (1 + (c_0 - 1) / C)."""
    extra = probe_cost - 1.0
    return 1.0 / (1.0 + (extra + abs(extra)) / (2 * probe_cycle(max_draft)))  # max(extra, 0), floats and arrays


def drafting_can_pay(round_costs: tuple[float, ...], max_draft: int) -> bool:
    """Whether any j >= 1 drafts (or the tree of depth k = max_draft, the entry after j = k) could beat resting were
    every draft accepted ((j + 1) / c_j tokens per plain step). Where none can (a compute-bound device at a large
    batch), the policy would only ever rest and probe, so adaptive decoding is plain decoding, without the probes."""
    best = max((min(j, max_draft) + 1) / cost for j, cost in enumerate(round_costs) if j > 0)
    return best > rest_value(round_costs[0], max_draft) * (1.0 + MARGIN)


def estimated_round_costs(trunk_bytes: int, draft_bytes: int, max_draft: int, tree: bool = False) -> tuple[float, ...]:
    """Costs of rounds with j = 0..k drafts in plain steps (then, with `tree`, a tree round of depth k's), for a
    memory-bound device: a verify pass reads the trunk once whatever its length (a tree's N + 1 rows too), a draft
    step reads the MTP layer and the draft head (a tree's k passes, each over all the nodes it expands, as many).
    A probe (j = 0) still extends the MTP cache and makes one draft (to keep measuring acceptance), so it costs one
    draft step too. Compute-bound settings (CPU, large batches) should pass measured costs instead
    (`python -m mtp_jax.bench`)."""
    step = draft_bytes / trunk_bytes
    chain = tuple(1.0 + max(j, 1) * step for j in range(max_draft + 1))
    return (*chain, chain[-1]) if tree else chain


def step_param_bytes(model) -> tuple[int, int]:
    """Parameter bytes a plain step reads (trunk layers, final norm, output head) and a draft step reads (the MTP
    layer and the rows of the draft vocabulary of its head). Embedding tables count only as the tied head."""
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    head = size((model.embed if model.lm_head is None else model.lm_head).get_value())  # as stored (int8: 1 byte)
    trunk = sum(size(nnx.state(segment)) for segment in model.segments) + size(nnx.state(model.final_norm)) + head
    if model.mtp is None:
        return trunk, 0
    mtp = nnx.state(model.mtp)
    draft_head = size(model.mtp.head.get_value()) if model.mtp.head is not None else head
    if model.draft_vocab is not None:
        draft_head = draft_head * model.draft_vocab[...].shape[0] // model.config.vocab_size
    own = sum(size(p.get_value()) for p in (model.mtp.head, model.mtp.embed) if p is not None)  # counted apart above
    return trunk, size(mtp) - own + draft_head
