"""Decoding on a `jax.sharding` mesh: the mesh from a spec, the logical-axis rules, placing parameters.

Code names logical axes only:
  batch, seq, embed, heads, kv_heads, head_dim, mlp, vocab, experts, expert_mlp (a routed expert's width), and
  layers (the stacked-layer axis).
One `ShardingRules` object maps them to the mesh axes `data`, `expert` and `model`: batch over `data`; routed experts
over `expert` and their width over `model`; everything else that tensor parallelism splits (query and kv heads,
dense and shared-expert MLP width, vocabulary) over `model` and `expert` together, so that on an expert mesh the
attention, dense layers, embedding and head are split over every chip instead of being held whole by each expert
shard. A dimension the mesh axes do not divide drops the trailing ones (kv heads: `model` alone, or replicated when
`model` does not divide them either: every model shard keeps all kv heads); a long
attention cache whose heads stay whole so (or that has none: MLA's latents) is split over its slots instead
(`ShardingRules.cache_spec`).

    mesh = make_mesh("data=2,model=4")            # or "auto": every device on `model`; in one process, a mesh of
                                                  # fewer devices than there are takes the first ones
    model = mtp_jax.load_model(path, mesh=mesh)   # each parameter lands directly in its NamedSharding
    out = mtp_jax.generate(model, ids, lens, key, cfg)  # caches and outputs sharded over `data`

Each parameter declares its logical axes where its module creates it (`nnx.Param(value, axes=(...))`, `AXES_KEY`);
`shard_model` places every parameter by the axes it declared (`param_axes`), and refuses one that declared none.

`constrain(x, ("batch", "seq", "embed"))` pins an activation's layout at a block boundary while a sharded model
is being traced (inside `generate`), and is a no-op otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import types
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "model")  # `model` innermost: neighbouring devices share a tensor-parallel group
LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "experts", "expert_mlp",
                "layers")  # fmt: skip

MeshAxes = str | tuple[str, ...] | None
Logical = Sequence[str | types.EllipsisType | None]


def parse_mesh_spec(spec: str, num_devices: int, *, subset: bool = False) -> dict[str, int]:
    """`data=D,model=M[,expert=E]` (missing axes are 1) or `auto` -> {axis: size}; the sizes must use every one of
    the `num_devices` devices (`subset`: at most that many; `auto` still takes them all)."""
    if spec.strip() == "auto":
        return {"data": 1, "expert": 1, "model": num_devices}
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for part in spec.split(","):
        name, _, value = (s.strip() for s in part.partition("="))
        if name not in MESH_AXES or name in seen or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad mesh spec {spec!r}: expected auto or data=D,model=M[,expert=E] with sizes >= 1")
        sizes[name] = int(value)
        seen.add(name)
    count = math.prod(sizes.values())
    if count > num_devices:
        raise ValueError(f"mesh {spec!r} has {count} devices but only {num_devices} are available")
    if count < num_devices and not subset:
        raise ValueError(
            f"mesh {spec!r} has {count} devices but {num_devices} are available (jax.device_count(), all processes "
            "together): a multi-process run uses every device of every process"
        )
    return sizes


def make_mesh(spec: str = "auto", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes (data, expert, model) from `spec` over `devices`.

    Default `devices`: in one process, the first ones of `jax.devices()` (all of them for `auto`; `data=1,model=4`
    on 8 devices takes devices 0-3); in a multi-process run, every device of every process, which the sizes must
    use. Given `devices`, the sizes must use all of them.
    Devices with physical coordinates (TPU slices) are laid out along the torus; a size that is no product of
    physical axis sizes (8 on a 4x4x4 slice) splits a physical axis. A layout no split makes is a ValueError."""
    subset = devices is None and jax.process_count() == 1
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec, len(devices), subset=subset)
    shape = tuple(sizes[a] for a in MESH_AXES)
    devices = devices[: math.prod(shape)]
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        pass  # no product of whole physical axes gives these sizes: split physical axes
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, NotImplementedError, ValueError) as e:
        raise ValueError(f"mesh {spec!r} cannot be laid out over these {len(devices)} devices' torus") from e
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


# Every parameter declares its logical axes where its module creates it, as metadata under this key:
# `nnx.Param(value, axes=("embed", "vocab"))`; leading stacked axes (nnx.vmap's) are `layers` (`param_axes`).
AXES_KEY = "axes"

# Activation and cache layouts the code constrains (checked for collisions with the parameters' layouts).
HIDDEN = ("batch", "seq", "embed")  # [B, T, D]
KV = ("batch", "seq", "kv_heads", "head_dim")  # [B, T, K, H]
CACHE = ("layers", "batch", "seq", "kv_heads", "head_dim")  # [L, B, S, K, H]
LATENT_CACHE = ("layers", "batch", "seq", None)  # [L, B, S, C]: no head axis
HEADS = ("batch", "seq", "heads", None)  # [B, T, N, .] per-head activations
DELTANET_CONV = ("layers", "batch", None, None)  # [L, B, W-1, C]: channels mix q, k and v of every head
DELTANET_STATE = ("layers", "batch", "heads", None, None)  # [L, B, N, H, Y] over value heads
DELTANET_BLOCK_INPUTS = ("batch", "seq", "mlp")  # [B, T, C] a verify block's conv inputs, as their projection gives
HEAD_SCALARS = ("batch", "seq", "heads")  # [B, T, N] one value per head (the delta rule's decay and beta)
LOGITS = ("batch", ..., "vocab")  # [B, ..., V]
DRAFT_HEAD = ("vocab", None)  # [Vd, D] the draft vocabulary's output rows, split as the lm_head's vocabulary
CONSTRAINED = (HIDDEN, KV, CACHE, LATENT_CACHE, HEADS, DELTANET_CONV, DELTANET_STATE, DELTANET_BLOCK_INPUTS,
               HEAD_SCALARS, LOGITS, DRAFT_HEAD)  # fmt: skip


def param_axes(variable, name: str) -> tuple[str | None, ...]:
    """Logical axes of an nnx variable (`name`: its path, for the error) as its module declared them (`AXES_KEY`),
    with `layers` for each leading stacked axis; a quantized weight's values and scales take the weight's (the
    scales' size-1 axes then stay whole). A variable created without axes is refused."""
    axes = variable.get_metadata().get(AXES_KEY)
    if axes is None:
        raise ValueError(f"parameter {name} declares no logical axes: create it with nnx.Param(value, axes=(...))")
    ndim = len(variable.get_value().shape)
    return ("layers",) * (ndim - len(axes)) + tuple(axes)


def param_layouts(module) -> dict[tuple[str, ...], tuple[str | None, ...]]:
    """The logical axes (`param_axes`) of every variable of `module` (an nnx module, abstract or not), by state path."""
    flat = nnx.to_flat_state(nnx.state(module))
    return {path: param_axes(variable, "/".join(path)) for path, variable in ((tuple(map(str, p)), v) for p, v in flat)}


def map_params(module, place: Callable[[jax.Array, tuple[str | None, ...]], object]):
    """A copy of `module` with every array `leaf` of every variable (both of a quantized weight) replaced by
    `place(leaf, its logical axes)`."""
    graphdef, state = nnx.split(module)
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        axes = param_axes(variable, "/".join(map(str, path)))
        variable.set_value(jax.tree.map(lambda leaf, axes=axes: place(leaf, axes), variable.get_value()))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Where each logical axis lives on `mesh`: a mesh axis, a tuple of mesh axes, or None (replicated).

    Hashable (it is part of a jitted function's static arguments through the model it is attached to).
    A layout that would put one mesh axis on two dimensions of the same tensor is refused: the activation and cache
    layouts when the rules are made, a parameter's declared layout when it is placed.
    Example: `ShardingRules(mesh, vocab=None)` keeps the embedding and lm_head whole on every device;
    `rules.sharding(("batch", None))` is the sharding of a [B, T] prompt batch.
    """

    mesh: Mesh
    batch: MeshAxes = "data"
    seq: MeshAxes = None
    embed: MeshAxes = None
    heads: MeshAxes = ("model", "expert")
    kv_heads: MeshAxes = ("model", "expert")
    head_dim: MeshAxes = None
    mlp: MeshAxes = ("model", "expert")
    vocab: MeshAxes = ("model", "expert")
    experts: MeshAxes = "expert"
    expert_mlp: MeshAxes = "model"
    layers: MeshAxes = None

    def __post_init__(self):
        for name in LOGICAL_AXES:
            for axis in self.mesh_axes(name):
                if axis not in self.mesh.axis_names:
                    raise ValueError(f"rules map {name} to mesh axis {axis!r}, which mesh {self.mesh.axis_names} lacks")
        for layout in CONSTRAINED:
            self.spec(layout)  # a parameter's declared layout is checked so when it is placed (`shard_model`)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes a logical axis is split over (empty: replicated)."""
        if logical is None:
            return ()
        if logical not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {logical!r}; known: {', '.join(LOGICAL_AXES)}")
        axes = getattr(self, logical)
        return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)

    def axis_size(self, logical: str) -> int:
        """How many shards the logical axis is split into."""
        return math.prod(self.mesh.shape[a] for a in self.mesh_axes(logical))

    def spec(self, logical: Logical, shape: Sequence[int] | None = None) -> PartitionSpec:
        """The PartitionSpec for a tensor with these logical axes (`...` stands for unsharded middle axes).

        With `shape`, a dimension the mapped mesh axes do not divide drops the trailing ones until they do (none
        left: replicated). Axes of size 1 are left out (`model` stands alone where `expert` is 1).
        """
        if ... in logical:
            at = list(logical).index(...)
            fill = 0 if shape is None else len(shape) - (len(logical) - 1)
            logical = (*logical[:at], *([None] * fill), *logical[at + 1 :])
        used: set[str] = set()
        parts = []
        for i, name in enumerate(logical):
            axes = self.mesh_axes(name)
            if used & set(axes):
                raise ValueError(f"layout {tuple(logical)} puts mesh axis {sorted(used & set(axes))} on two dimensions")
            used |= set(axes)
            if shape is not None:
                while axes and shape[i] % math.prod(self.mesh.shape[a] for a in axes):
                    axes = axes[:-1]
            axes = tuple(a for a in axes if self.mesh.shape[a] > 1) or axes[:1]
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*parts)

    def slot_axes(self, logical: Logical, shape: Sequence[int]) -> tuple[str, ...]:
        """The mesh axes a long cache with these logical axes (its slot axis named `seq`) and `shape` splits its slots
        over (`cache_spec`; the slot count itself is not looked at): when no other dimension takes `model` (kv heads
        that `model` does not divide, or no head axis: MLA's latents), `model` and `expert` (those larger than 1);
        none otherwise, or when its slots already take a mesh axis. A cache with no head axis on a mesh with an
        `expert` axis: `expert` only, each device attending beside its slots only the heads `model` gives it
        (`constrain_beside_slots`), for `model` copies of the cache (split over all of DeepSeek-V3's 64 chips, every
        head beside them, a plain step at batch 8 moved 1.5 GiB of latent attention's activations)."""
        used = {axis for part in self.spec(logical, shape) if part for axis in _axes_of(part)}
        if "model" in used or self.mesh_axes("seq"):
            return ()
        axes = tuple(axis for axis in ("expert", "model") if axis not in used and self.mesh.shape[axis] > 1)
        if "heads" not in logical and "kv_heads" not in logical and "expert" in axes:
            return ("expert",)
        return axes

    def cache_spec(self, logical: Logical, shape: Sequence[int], chunk: int) -> PartitionSpec:
        """The PartitionSpec of a cache with these logical axes (slot axis `seq`) and `shape`: as `spec`, with its slots
        split over `slot_axes` when each of the M shards then holds whole `chunk`s of slots (a long cache, attended
        chunk by chunk): M devices hold 1/M of it each instead of all of it."""
        parts = list(self.spec(logical, shape))
        if self.slot_shards(logical, shape, chunk) > 1:
            axes = self.slot_axes(logical, shape)
            parts[list(logical).index("seq")] = axes[0] if len(axes) == 1 else axes
        return PartitionSpec(*parts)

    def slot_shards(self, logical: Logical, shape: Sequence[int], chunk: int) -> int:
        """M: how many shards `cache_spec` splits the slots of such a cache into (1: not split)."""
        shards = math.prod(self.mesh.shape[axis] for axis in self.slot_axes(logical, shape))
        return shards if shape[list(logical).index("seq")] % (shards * chunk) == 0 else 1

    def sharding(self, logical: Logical, shape: Sequence[int] | None = None) -> NamedSharding:
        """The NamedSharding on this mesh for a tensor with these logical axes (see `spec`)."""
        return NamedSharding(self.mesh, self.spec(logical, shape))


_ACTIVE: contextvars.ContextVar[ShardingRules | None] = contextvars.ContextVar("mtp_jax_sharding", default=None)


@contextlib.contextmanager
def activate(rules: ShardingRules | None) -> Iterator[None]:
    """Make `constrain` pin layouts with `rules` while tracing inside this block (None: constrain does nothing)."""
    token = _ACTIVE.set(rules)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical: Logical) -> jax.Array:
    """`x` with its layout pinned to these logical axes under the active rules; `x` itself without rules."""
    rules = _ACTIVE.get()
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, rules.sharding(logical, x.shape))


def slot_shards(logical: Logical, shape: Sequence[int], chunk: int) -> int:
    """M: how many shards the active rules split the slots of a cache with these logical axes and `shape` into
    (`ShardingRules.cache_spec`); 1 without rules."""
    rules = _ACTIVE.get()
    return 1 if rules is None else rules.slot_shards(logical, shape, chunk)


def constrain_beside_slots(x: jax.Array, logical: Logical, shape: Sequence[int], chunk: int) -> jax.Array:
    """Per-head activations x [B, T, N, .] (or [M * B, T, N, .]: run m of row b at m * B + b) pinned to attend a
    cache with these logical axes and `shape` split over its slots: rows with their slot shard (the slot axes, then
    the batch's), heads over the heads' axes other than the slots' (each device attends beside its slots the heads
    the rest of its mesh coordinates give it; none left: every head); `x` itself without rules or such a split."""
    rules = _ACTIVE.get()
    if rules is None or rules.slot_shards(logical, shape, chunk) == 1:
        return x
    slots = rules.slot_axes(logical, shape)
    rows = (*(slots if x.shape[0] > shape[0] else ()), *rules.mesh_axes("batch"))
    heads = tuple(axis for axis in rules.mesh_axes("heads") if axis not in slots)
    while heads and x.shape[2] % math.prod(rules.mesh.shape[axis] for axis in heads):
        heads = heads[:-1]  # as `spec` drops the axes that do not divide the heads
    part = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes
    spec = PartitionSpec(part(rows), None, part(heads), *(None,) * (x.ndim - 3))
    return jax.lax.with_sharding_constraint(x, NamedSharding(rules.mesh, spec))


def constrain_cache(x: jax.Array, logical: Logical, chunk: int) -> jax.Array:
    """A cache `x` pinned to `ShardingRules.cache_spec` under the active rules; `x` itself without rules."""
    rules = _ACTIVE.get()
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(rules.mesh, rules.cache_spec(logical, x.shape, chunk)))


def _axes_of(part: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def _block_key(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def place(
    shape: Sequence[int],
    sharding: NamedSharding,
    read_blocks: Callable[[list[tuple[slice, ...]]], list[np.ndarray]],
) -> jax.Array:
    """A global array in `sharding` whose local shards come from host blocks.

    `read_blocks(blocks)` returns one host array per block (a tuple of unit-step slices into the full array);
    it is asked once, for the distinct blocks this process's devices hold, so replicas are read once and no
    process reads another's shards.
    """
    shape = tuple(shape)
    blocks = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        key = _block_key(index, shape)
        blocks.setdefault(key, tuple(slice(start, stop) for start, stop in key))
    arrays = dict(zip(blocks, read_blocks(list(blocks.values())), strict=True))
    return jax.make_array_from_callback(shape, sharding, lambda index: arrays[_block_key(index, shape)])


def place_host_array(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array (the same on every process) placed in `sharding`, each device receiving only its shard."""
    array = np.asarray(array)
    return place(array.shape, sharding, lambda blocks: [array[b] for b in blocks])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole of a (possibly multi-process) array as a NumPy array, on every process."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def rules_for(mesh: Mesh | ShardingRules | None) -> ShardingRules | None:
    """The default rules for a mesh (rules pass through; None stays None)."""
    return mesh if mesh is None or isinstance(mesh, ShardingRules) else ShardingRules(mesh)


def path_names(path) -> list[str]:
    """The names along a pytree key path (dict keys, attribute names of dataclass fields, sequence indices)."""
    return [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]


def shard_model(model, mesh: Mesh | ShardingRules):
    """`model` with every parameter moved into the sharding of its declared logical axes and the rules attached (so
    `generate` shards too)."""
    rules = rules_for(mesh)

    def put(value, axes):
        sharding = rules.sharding(axes, value.shape)
        if sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
        return place_host_array(np.asarray(value), sharding)

    sharded = map_params(model, put)
    sharded.sharding_rules = rules
    return sharded


def active_rules() -> ShardingRules | None:
    """The rules `activate` made current (None outside a sharded model's tracing)."""
    return _ACTIVE.get()


def one_device_active() -> bool:
    """Whether what is traced now runs on one device (no rules, or a mesh of one): where a custom kernel, which XLA's
    partitioner does not split, may stand in for an op."""
    rules = active_rules()
    return rules is None or rules.mesh.size == 1


def mesh_platform(mesh) -> str:
    """The platform of a mesh's devices: "cpu", "gpu" or "tpu" (compile-only devices name theirs alike)."""
    return next(iter(mesh.devices.flat)).platform


def active_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the active rules' mesh, else of the default backend."""
    rules = active_rules()
    return mesh_platform(rules.mesh) if rules is not None else jax.default_backend()
