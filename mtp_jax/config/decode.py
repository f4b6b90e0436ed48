"""The decode settings (`DecodeConfig`): frozen and hashable, a static argument of the jitted loop."""

from __future__ import annotations

import dataclasses
import math

from mtp_jax.config.execution_plan import ExecutionPlan


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static decode settings (part of the jit cache key).

    num_draft: drafts per round (k); 0 is plain decoding through the same loop.
    max_new_tokens: per-row budget of generated tokens.
    temperature / top_k / top_p: defaults for every row; per-row arrays passed to `generate` override them.
    stop_on_eos: stop a row at the model's EOS ids (a checkpoint without one decodes to max_new_tokens).
    adaptive: each round drafts j <= num_draft tokens, j chosen on device from running acceptance and
      `round_costs` (mtp_jax.decode.adaptive); num_draft is then the most a round may draft. With `tree`, a round
      may also be a draft tree's (of depth num_draft), chosen the same way from the tree's own acceptance.
    round_costs: time of a round with j = 0..num_draft drafts over a plain round, j = 0 being a probe over an MTP
      block that rests filled, then, with `tree`, a tree round's (measured, e.g. by `python -m mtp_jax.bench`);
      None estimates them from parameter bytes (right for memory-bound devices).
    invariant: batch-invariant numerics: each row's tokens the same whatever else shares its passes (other rows,
      their lengths, a verify block's other positions), so greedy MTP equals plain decoding in bfloat16 too, at any
      batch size (models/cache_attention.py: `attend_written_cache`; caches are sized in whole attention chunks;
      on one GPU every product runs in fixed tiles: kernels/fixed_tiles.py). Always on for a model whose 4-bit
      weights multiply activations rounded to int8 (`quant.has_int8_activations`): a last-bit difference between a
      verify block's sums and a plain step's moves a rounded activation by a whole step, so only batch-invariant passes
      keep MTP equal to plain there.
    tree: a draft tree's node budget N (0: a chain of num_draft drafts). Each round the MTP head expands, depth by
      depth, the `tree_width` best nodes by path probability, down to depth D = num_draft (the longest path a round
      can accept, as a chain's k; `tree_depth`), and the trunk verifies the N best nodes of all it proposed in one
      pass (mtp_jax.decode.tree).
    tree_width: W, the nodes expanded at each depth (each proposes up to N children, the root too).
    plan: which implementation each operation takes (config/execution_plan.py); None: the plan for the model's mesh
      here, resolved by `generate` and the `Engine` before they trace, so that the plan is part of the program's key.
    """

    num_draft: int = 3
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_on_eos: bool = True
    adaptive: bool = False
    round_costs: tuple[float, ...] | None = None
    invariant: bool = False
    tree: int = 0
    tree_width: int = 4
    plan: ExecutionPlan | None = None

    def __post_init__(self):
        if self.num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {self.num_draft}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.tree:
            self._check_tree()
        if self.plan is not None and self.plan.invariant != self.invariant:
            raise ValueError(f"the execution plan's invariant ({self.plan.invariant}) differs from the config's")
        if self.round_costs is not None:
            costs, k = tuple(self.round_costs), self.num_draft
            wanted = k + 1 + (1 if self.tree else 0)
            if len(costs) != wanted or not all(math.isfinite(c) and c > 0 for c in costs):
                what = f"j = 0..{k}" + (", then the tree's round" if self.tree else "")
                raise ValueError(f"round_costs needs {wanted} positive numbers ({what}), got {costs}")

    def _check_tree(self):
        depth, width = self.num_draft, self.tree_width
        if self.tree < 0 or width < 1:
            raise ValueError(f"a draft tree needs tree >= 0 and tree_width >= 1, got {self.tree} and {width}")
        if depth < 1:
            raise ValueError(f"a draft tree needs a depth (num_draft) >= 1, got {depth}")
        if self.tree < depth:
            raise ValueError(f"a tree of depth {depth} holds at least {depth} nodes, not {self.tree}")

    @property
    def tree_depth(self) -> int:
        """A draft tree's depth D: num_draft (0 without a tree)."""
        return self.num_draft if self.tree else 0

    @property
    def round_slots(self) -> int:
        """Cache slots a round's passes write from a row's pending position on: the verify block (the pending token
        and the drafts, or a tree's nodes), or a tree's MTP expansion passes where they are wider."""
        if not self.tree:
            return self.num_draft + 1
        return max(self.tree, (self.num_draft - 1) * self.tree_width) + 1
