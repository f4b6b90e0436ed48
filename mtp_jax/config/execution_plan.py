"""The execution plan: which implementation each operation of a traced program takes, decided once.

A plan is one frozen, hashable, printable value. kernels/traced_plan.py's `resolve` builds it before a program is
traced, from the platform and size of the mesh, whether the decode is batch-invariant, the kernels built on this
machine and, on a CPU, where the row kernel beat XLA's products here (kernels/cpu/kernel_choice.py). Decode programs
take it as static configuration (`DecodeConfig.plan`), so it is part of their jit key and of the executable cache's
key: two runs that differ only in their plan never share a compiled program. A test or a user may pass any other plan
(`dataclasses.replace(plan, products=Products.XLA)`, `xla_only`).

While a program is traced, `traced_plan.tracing(plan)` hands the plan to the layers (`traced_plan.current`): their
products, attention, routed experts and delta rule go where its members say (kernels/dispatch.py), and a kernel
still declines what it cannot read (a shape, a dtype), which then runs in XLA's form.
"""

from __future__ import annotations

import dataclasses
import enum


class Products(enum.Enum):
    """Projections (activations by a weight)."""

    XLA = "xla"  # XLA's dot (a quantized weight's blocked product: quant/blocked_product.py)
    CPU_ROWS = "cpu_rows"  # the CPU row kernel (kernels/cpu/cpu_rows.py): where it beat XLA; all it reads if invariant
    FIXED_TILES = "fixed_tiles"  # fixed tiles whatever the pass (kernels/fixed_tiles.py): a GPU's invariant decode


class DecodeAttention(enum.Enum):
    """Attention of a decode step or verify block over the cache (and of every pass under batch-invariant decoding)."""

    XLA = "xla"  # models/cache_attention.py's one-pass, chunked or batch-invariant form
    CPU_KERNEL = "cpu_attention"  # one call reading the cache once for a block's rows (kernels/cpu/cpu_attention.py)


class SmallPassExperts(enum.Enum):
    """A decode step's or verify block's routed experts (models/moe.py: at most DENSE_EXPERT_ROWS rows)."""

    EVERY_EXPERT = "every_expert"  # every expert on every row, weighted by the routing (plain dots)
    GATHER = "gather"  # XLA's gather of the used experts, where that copy costs less (kernels/routed_kernel.py)
    PALLAS = "pallas"  # a TPU kernel reading each used expert where it lies in the stack


class LargePassExperts(enum.Enum):
    """A larger pass's routed experts (a prefill, a large batch's verify block)."""

    RAGGED_DOT = "ragged_dot"  # XLA's grouped matmul over the rows sorted by expert
    PALLAS_GROUPED = "pallas_grouped"  # a TPU grouped matmul reading each used expert once (kernels/grouped_kernel.py)


class DeltaRule(enum.Enum):
    """A gated DeltaNet's token-by-token delta rule (models/gated_deltanet.py)."""

    XLA_SCAN = "xla_scan"
    PALLAS = "pallas"  # kernels/delta_rule_kernel.py (a TPU; Pallas' interpreter elsewhere)


class VerifyLogits(enum.Enum):
    """The lm_head over a greedy verify block's rows (decode/rounds.py's `verify`)."""

    BLOCK = "block"  # every row's logits in one product: a read of the lm_head, whatever its rows (an accelerator)
    ROW_BY_ROW = "row_by_row"  # a position at a time, while some row has accepted every draft before it: the CPU
    # row kernel's sums cost in proportion to the rows, so a rejected draft's later rows are not worth computing


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """What each operation of a program takes (module docstring).

    platform: "cpu", "gpu" or "tpu"; one_device: the program runs on one device (a custom call is not split by
    XLA's partitioner); invariant: a batch-invariant decode (DecodeConfig.invariant). kernel_loses: with
    CPU_ROWS outside batch-invariant decoding, the products XLA's form won here ("form@rows", the keys of
    kernel_choice.py's table), which stay with XLA."""

    platform: str
    one_device: bool = True
    invariant: bool = False
    products: Products = Products.XLA
    attention: DecodeAttention = DecodeAttention.XLA
    small_experts: SmallPassExperts = SmallPassExperts.EVERY_EXPERT
    large_experts: LargePassExperts = LargePassExperts.RAGGED_DOT
    delta_rule: DeltaRule = DeltaRule.XLA_SCAN
    verify_logits: VerifyLogits = VerifyLogits.BLOCK
    kernel_loses: tuple[str, ...] = ()

    def __post_init__(self):
        if self.platform not in ("cpu", "gpu", "tpu"):
            raise ValueError(f"an execution plan's platform is cpu, gpu or tpu, not {self.platform!r}")
        custom = self.products is not Products.XLA or self.attention is not DecodeAttention.XLA
        if custom and not self.one_device:
            raise ValueError("a plan for several devices runs products and attention in XLA's forms")

    @property
    def reads_stacks_in_place(self) -> bool:
        """Whether a layer stack's weights reach the products whole (ops/stacked_weights.py): the CPU row kernel reads
        a layer's weight where it lies in the stack (XLA copies a slice at a traced offset)."""
        return self.products is Products.CPU_ROWS

    @property
    def reads_expert_stacks_in_place(self) -> bool:
        """Whether a stack's routed-expert weights reach the MoE layers whole: a routed form here reads a layer's
        experts where they lie (it runs inside the experts' `shard_map`, so on any number of devices)."""
        return self.small_experts is not SmallPassExperts.EVERY_EXPERT or (
            self.large_experts is not LargePassExperts.RAGGED_DOT
        )

    def as_dict(self) -> dict:
        """The plan as JSON values (`decode --stats-json`, `plan`'s JSON)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value.value if isinstance(value, enum.Enum) else value for name, value in fields.items()} | {
            "kernel_loses": list(self.kernel_loses)
        }

    def summary(self) -> str:
        """One line: the platform and each operation's implementation."""
        where = f"{self.platform}, {'one device' if self.one_device else 'several devices'}"
        parts = [
            f"products {self.products.value}"
            + (f" (XLA where it won: {', '.join(self.kernel_loses)})" if self.kernel_loses else ""),
            f"decode attention {self.attention.value}",
            f"routed experts {self.small_experts.value} / {self.large_experts.value}",
            f"delta rule {self.delta_rule.value}",
            f"verify logits {self.verify_logits.value}",
        ]
        return f"{where}{', batch-invariant' if self.invariant else ''}: " + "; ".join(parts)


def invariant_trees(plan: ExecutionPlan) -> bool:
    """Whether batch-invariant decoding under `plan` attends a draft tree's block by its mask: the CPU kernel does
    (models/cache_attention.py's batch-invariant XLA form takes no mask)."""
    return plan.attention is DecodeAttention.CPU_KERNEL


def xla_only(platform: str, one_device: bool = True, invariant: bool = False) -> ExecutionPlan:
    """XLA's forms for every operation (no custom call)."""
    return ExecutionPlan(platform, one_device, invariant)
