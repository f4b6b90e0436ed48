"""The one dispatch between the models' products and attention and the kernels that can run them.

What a program traced now may use is one frozen `Numerics`: the platform, whether it runs on one device (a custom
kernel is not split by XLA's partitioner), whether a batch-invariant decode is traced, and the kernels available to
it. It is built once per trace (`tracing`, entered by `speculative` and `invariance` around what they trace) and
read by every product: `project` walks the registered implementations in their order and takes the first that
accepts (the product's equation, operands and the Numerics); XLA's own form (ops/rowwise.py) takes the rest.
Attention the same (`attend`): a registered kernel, or None for XLA's forms. A pass's routed experts the same
(`experts_implementation`): a registered form that reads only the experts the pass uses, or None for XLA's forms
(every expert on every row for a small pass, grouped matmuls for a large one: models/moe.py). A gated DeltaNet's
token-by-token delta rule the same (`delta_rule_implementation`): a registered kernel, or None for XLA's scan
(models/gated_deltanet.py).

Kernels register themselves when imported (kernels/cpu/cpu_rows.py: the CPU row kernel and, from the same library, the
decode attention of kernels/cpu/cpu_attention.py; kernels/fixed_tiles.py: a GPU's fixed tiles); the models import only
this module. A new kernel (a TPU Pallas one, say) is one more module that registers an implementation, and says in
`accepts` what it takes: which platforms, weight formats and shapes, and where it won against XLA's form on this
machine (kernels/cpu/kernel_choice.py measures that for the CPU kernel).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

from mtp_jax.parallel.sharding import active_platform, one_device_active


@dataclasses.dataclass(frozen=True)
class Numerics:
    """What the products and attention of a program traced now may use.

    platform: "cpu", "gpu" or "tpu" (of the active mesh, else the default backend); one_device: no mesh of several
    devices is active; invariant: a batch-invariant decode is traced (DecodeConfig.invariant); kernels: the names of
    the registered kernels available here (built, loaded and meant for this platform), sorted: the repr is part of
    the key of a program kept on disk (executable_cache.py), the same in every process."""

    platform: str
    one_device: bool
    invariant: bool
    kernels: tuple[str, ...]
    stack_readers: tuple[str, ...] = ()  # of those, the ones that read a layer's weight in its stack
    expert_stack_readers: tuple[str, ...] = ()  # of those, the ones that read a layer's experts in their stack

    def has(self, kernel: str) -> bool:
        """Whether `kernel` may run a custom call in this program: available, and on one device."""
        return self.one_device and kernel in self.kernels

    @property
    def reads_stacks_in_place(self) -> bool:
        """Whether a layer stack's weights reach the products whole (ops/stacked_weights.py), for a kernel that
        reads a layer's weight where it lies in the stack (XLA copies a slice at a traced offset)."""
        return any(self.has(kernel) for kernel in self.stack_readers)

    @property
    def reads_expert_stacks_in_place(self) -> bool:
        """Whether a layer stack's routed-expert weights reach the MoE layers whole: a kernel here reads a layer's
        experts where they lie (it runs inside the experts' `shard_map`, so on any number of devices)."""
        return any(kernel in self.kernels for kernel in self.expert_stack_readers)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A way to run products (`run(equation, x, weight, out_dtype)`), attention (`run(...)`, the operands of
    `cache_attention.grouped_attention`), a pass's routed experts (`run(x, weights, ids, layer, gate, up,
    down)`, kernels/routed_kernel.py, kernels/grouped_kernel.py) or the delta rule (`run(q, k, v, g, beta, state,
    steps, final, parents=None)`, kernels/delta_rule_kernel.py), taken where `accepts(numerics, ...)` says yes."""

    name: str
    accepts: Callable[..., bool]
    run: Callable[..., jax.Array]
    takes_block_mask: bool = False  # attention: it attends a draft tree's block by its mask, batch-invariantly


_PRODUCTS: list[Implementation] = []
_ATTENTION: list[Implementation] = []
_EXPERTS: list[Implementation] = []
_DELTA_RULE: list[Implementation] = []
_AVAILABLE: dict[str, Callable[[str], bool]] = {}  # kernel name -> whether it is available on a platform
_STACK_READERS: set[str] = set()  # kernels that read a layer's weight in place from its stack
_EXPERT_STACK_READERS: set[str] = set()  # kernels that read a layer's routed experts in place from their stack
_ORDER: dict[str, int] = {}  # kernel name -> its place among the implementations (lowest tried first)
_CURRENT: contextvars.ContextVar[Numerics | None] = contextvars.ContextVar("mtp_jax_numerics", default=None)


def register_kernel(name: str, available: Callable[[str], bool], products: Implementation | None = None,
                    attention: Implementation | None = None, reads_stacks: bool = False,
                    experts: Implementation | None = None, reads_expert_stacks: bool = False,
                    delta_rule: Implementation | None = None, order: int = 0) -> None:  # fmt: skip
    """Register a kernel: `available(platform)` says whether it can run there (built and loaded); its product,
    attention, routed-experts and delta-rule implementations, tried by `order` (lowest first; the order of
    registration among equals) before XLA's forms; `reads_stacks`: its products read a layer's weight in place from
    its stack; `reads_expert_stacks`: its experts form reads a layer's experts so. Registering a name again replaces
    it (a module reloaded)."""
    _AVAILABLE[name] = available
    _ORDER[name] = order
    if reads_stacks:
        _STACK_READERS.add(name)
    if reads_expert_stacks:
        _EXPERT_STACK_READERS.add(name)
    kinds = ((_PRODUCTS, products), (_ATTENTION, attention), (_EXPERTS, experts), (_DELTA_RULE, delta_rule))
    for registry, implementation in kinds:
        registry[:] = [i for i in registry if i.name != name]
        if implementation is not None:
            registry.append(dataclasses.replace(implementation, name=name))
        registry.sort(key=lambda i: _ORDER[i.name])


def here(invariant: bool = False) -> Numerics:
    """The Numerics of a program traced now (under the active mesh, if any)."""
    platform = active_platform()
    available = sorted(name for name, check in _AVAILABLE.items() if check(platform))
    readers = tuple(name for name in available if name in _STACK_READERS)
    expert_readers = tuple(name for name in available if name in _EXPERT_STACK_READERS)
    return Numerics(platform, one_device_active(), invariant, tuple(available), readers, expert_readers)


@contextlib.contextmanager
def tracing(invariant: bool) -> Iterator[Numerics]:
    """Trace inside this block with one Numerics, built now (batch-invariant decoding when `invariant`)."""
    numerics = here(invariant)
    token = _CURRENT.set(numerics)
    try:
        yield numerics
    finally:
        _CURRENT.reset(token)


def current() -> Numerics:
    """The Numerics of the trace under way (`tracing`), or one built now for default numerics."""
    return _CURRENT.get() or here()


def invariant_trees_here() -> bool:
    """Whether batch-invariant decoding traced now has an attention kernel that takes a draft tree's block mask
    (the batch-invariant XLA form takes none)."""
    numerics = here(invariant=True)
    return any(i.takes_block_mask and numerics.has(i.name) for i in _ATTENTION)


def product_implementation(equation: str, x: jax.Array, weight: Any) -> Implementation | None:
    """The first registered product implementation that accepts this product now, or None (XLA's form)."""
    numerics = current()
    return next((i for i in _PRODUCTS if i.accepts(numerics, equation, x, weight)), None)


def attention_implementation(q: jax.Array, past_k: Any, shards: int, whole_pass: bool) -> Implementation | None:
    """The first registered attention kernel that accepts these queries [B, T, N, H] over this cache now, or None
    (XLA's forms). `whole_pass`: the batch-invariant form asks for every pass, prefills included."""
    numerics = current()
    return next((i for i in _ATTENTION if i.accepts(numerics, q, past_k, shards, whole_pass)), None)


def experts_implementation(x: jax.Array, ids: jax.Array, gate: Any, up: Any, down: Any,
                           manual: bool, small: bool) -> Implementation | None:  # fmt: skip
    """The first registered routed-experts form that accepts this pass now (rows x [M, D], local expert ids
    [M, O], the expert stacks [L, E, ...]), or None (every expert on every row for a small pass, XLA's grouped
    matmuls for a large one). `manual`: the pass runs on one device or inside the experts' shard_map (a custom call
    is not split by XLA's partitioner). `small`: a decode step or verify block of at most `moe.DENSE_EXPERT_ROWS`
    rows."""
    numerics = current()
    found = (
        i for i in _EXPERTS if i.name in numerics.kernels and i.accepts(numerics, x, ids, gate, up, down, manual, small)
    )
    return next(found, None)


def delta_rule_implementation(k: jax.Array, state: jax.Array) -> Implementation | None:
    """The first registered delta-rule kernel that accepts these keys [B, T, N, H] and states [B, N, H, Y] now, or
    None (XLA's scan)."""
    numerics = current()
    return next((i for i in _DELTA_RULE if i.name in numerics.kernels and i.accepts(numerics, k, state)), None)


def registered_product(name: str) -> Implementation | None:
    """The product implementation registered under `name` (None: not registered)."""
    return next((i for i in _PRODUCTS if i.name == name), None)
