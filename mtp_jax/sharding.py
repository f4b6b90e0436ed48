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

    mesh = make_mesh("data=2,model=4")            # or "auto": every device on `model`
    model = mtp_jax.load_model(path, mesh=mesh)   # each parameter lands directly in its NamedSharding
    out = mtp_jax.generate(model, ids, lens, key, cfg)  # caches and outputs sharded over `data`

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
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "model")  # `model` innermost: neighbouring devices share a tensor-parallel group
LOGICAL_AXES = (
    "batch",
    "seq",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "experts",
    "expert_mlp",
    "layers",
)

MeshAxes = str | tuple[str, ...] | None
Logical = Sequence[str | types.EllipsisType | None]


def parse_mesh_spec(spec: str, num_devices: int) -> dict[str, int]:
    """`data=D,model=M[,expert=E]` (missing axes are 1) or `auto` -> {axis: size}; the sizes must use every device."""
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
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(
            f"mesh {spec!r} has {math.prod(sizes.values())} devices but {num_devices} are available "
            "(jax.device_count(), all processes together)"
        )
    return sizes


def make_mesh(spec: str = "auto", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes (data, expert, model) from `spec` over `devices` (default: every device of every process).

    Devices with physical coordinates (TPU slices) are laid out along the torus; a size that is no product of
    physical axis sizes (8 on a 4x4x4 slice) splits a physical axis. A layout no split makes is a ValueError."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
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


# Logical axes of every parameter, by the last components of its path (the longest match wins); leading stacked
# axes are `layers`. A parameter with no entry is refused by `param_axes`, so a new block must add its own here.
PARAM_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed",): ("vocab", "embed"),  # [V, D]; also the MTP layer's own embedding
    ("lm_head",): ("embed", "vocab"),
    ("mtp", "head"): ("embed", "vocab"),  # the MTP layer's own lm_head
    ("mtp", "proj"): (None, "embed"),  # [2D, D]: the fused [e, h] input is not a model axis
    ("draft_vocab",): (None,),  # a few thousand token ids
    ("scale",): ("embed",),  # RMSNorm weights over the model width
    ("q_norm", "scale"): ("head_dim",),
    ("k_norm", "scale"): ("head_dim",),
    # GQA attention
    ("q_proj",): ("embed", "heads", "head_dim"),  # also MLA's [D, N, H+P] without a query LoRA
    ("k_proj",): ("embed", "kv_heads", "head_dim"),
    ("v_proj",): ("embed", "kv_heads", "head_dim"),
    ("o_proj",): ("heads", "head_dim", "embed"),  # also MLA's [N, W, D]
    ("q_bias",): ("heads", "head_dim"),
    ("k_bias",): ("kv_heads", "head_dim"),
    ("v_bias",): ("kv_heads", "head_dim"),
    ("o_bias",): ("embed",),
    # latent attention (MLA): the low-rank projections and the latent are shared by all heads
    ("q_a_proj",): ("embed", None),  # [D, Q]
    ("q_a_norm", "scale"): (None,),
    ("q_b_proj",): (None, "heads", "head_dim"),  # [Q, N, H+P]
    ("kv_a_proj",): ("embed", None),  # [D, R+P]
    ("kv_a_norm", "scale"): (None,),
    ("kv_b_proj",): (None, "heads", "head_dim"),  # [R, N, H+W]
    # dense MLP (and shared experts)
    ("gate_proj",): ("embed", "mlp"),
    ("up_proj",): ("embed", "mlp"),
    ("down_proj",): ("mlp", "embed"),
    ("gate_bias",): ("mlp",),
    ("up_bias",): ("mlp",),
    ("down_bias",): ("embed",),
    # routed experts
    ("router",): ("embed", None),  # [D, E]: every shard scores every expert
    ("router_bias",): (None,),
    ("expert_gate",): ("experts", "embed", "expert_mlp"),
    ("expert_up",): ("experts", "embed", "expert_mlp"),
    ("expert_down",): ("experts", "expert_mlp", "embed"),
    # gated attention (Qwen3-Next, Qwen3.5): the output gate has the query's layout
    ("attn", "gate_proj"): ("embed", "heads", "head_dim"),
    # softmax-routed experts: the shared expert's per-token gate
    ("shared", "gate"): ("embed",),
    # gated DeltaNet: the q, k, v channel projection split like an MLP width (the short conv then gathers the
    # step's [B, T, C] channels, which the conv state and weight keep whole); the per-value-head projections over heads
    ("in_proj_qkv",): ("embed", "mlp"),  # [D, C]
    ("conv",): (None, None),  # [W, C]
    ("in_proj_z",): ("embed", "heads", None),  # [D, N, Y]
    ("in_proj_b",): ("embed", "heads"),  # [D, N]
    ("in_proj_a",): ("embed", "heads"),
    ("dt_bias",): ("heads",),
    ("A_log",): ("heads",),
    ("attn", "norm", "scale"): (None,),  # [Y] the gated output norm, per value-head dim
    ("out_proj",): ("heads", None, "embed"),  # [N, Y, D]
}

# Activation and cache layouts the code constrains (checked for collisions with the parameters' layouts).
HIDDEN = ("batch", "seq", "embed")  # [B, T, D]
KV = ("batch", "seq", "kv_heads", "head_dim")  # [B, T, K, H]
CACHE = ("layers", "batch", "seq", "kv_heads", "head_dim")  # [L, B, S, K, H]
LATENT_CACHE = ("layers", "batch", "seq", None)  # [L, B, S, C]: no head axis
HEADS = ("batch", "seq", "heads", None)  # [B, T, N, .] per-head activations
WHOLE_HEADS = ("batch", "seq", None, None)  # [B, T, N, .] every head on every device: beside a cache split over slots
DELTANET_CONV = ("layers", "batch", None, None)  # [L, B, W-1, C]: channels mix q, k and v of every head
DELTANET_STATE = ("layers", "batch", "heads", None, None)  # [L, B, N, H, Y] over value heads
LOGITS = ("batch", ..., "vocab")  # [B, ..., V]


QUANTIZED_PARTS = ("values", "scales")  # the arrays of a quantized weight (mtp_jax.quant), laid out as the weight


def param_axes(path: Sequence[str], ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at `path` (its nnx state path) with `ndim` dimensions; a quantized weight's
    values and scales take the weight's (the scales' size-1 axes then stay whole)."""
    path = tuple(str(p) for p in path)
    if path and path[-1] in QUANTIZED_PARTS:
        path = path[:-1]
    for n in range(len(path), 0, -1):
        axes = PARAM_AXES.get(path[-n:])
        if axes is not None and len(axes) <= ndim:
            return ("layers",) * (ndim - len(axes)) + axes
    raise ValueError(f"no logical axes for parameter {'/'.join(path)}: add it to PARAM_AXES in {__name__}")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Where each logical axis lives on `mesh`: a mesh axis, a tuple of mesh axes, or None (replicated).

    Hashable (it is part of a jitted function's static arguments through the model it is attached to).
    A layout that would put one mesh axis on two dimensions of the same tensor is refused when the rules are made.
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
        for layout in (*PARAM_AXES.values(), HIDDEN, KV, CACHE, LATENT_CACHE, HEADS, WHOLE_HEADS, DELTANET_CONV,
                       DELTANET_STATE, LOGITS):  # fmt: skip
            self.spec(layout)

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
        none otherwise, or when its slots already take a mesh axis."""
        used = {axis for part in self.spec(logical, shape) if part for axis in _axes_of(part)}
        if "model" in used or self.mesh_axes("seq"):
            return ()
        return tuple(axis for axis in ("expert", "model") if axis not in used and self.mesh.shape[axis] > 1)

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

    def param_sharding(self, path: Sequence[str], shape: Sequence[int]) -> NamedSharding:
        """The NamedSharding of the parameter at `path` (its nnx state path) with `shape`."""
        return self.sharding(param_axes(path, len(shape)), shape)


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
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def rules_for(mesh: Mesh | ShardingRules | None) -> ShardingRules | None:
    """The default rules for a mesh (rules pass through; None stays None)."""
    return mesh if mesh is None or isinstance(mesh, ShardingRules) else ShardingRules(mesh)


def path_names(path) -> list[str]:
    """The names along a pytree key path (dict keys, attribute names of dataclass fields, sequence indices)."""
    return [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]


def shard_model(model, mesh: Mesh | ShardingRules):
    """`model` with every parameter moved into its sharding and the rules attached (so `generate` shards too)."""
    from flax import nnx

    rules = rules_for(mesh)
    graphdef, state = nnx.split(model)

    def put(path, value):
        sharding = rules.param_sharding(path_names(path), value.shape)
        if sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
        return place_host_array(np.asarray(value), sharding)

    params = jax.tree_util.tree_map_with_path(put, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    sharded = nnx.merge(graphdef, state)
    sharded.sharding_rules = rules
    return sharded


def active_rules() -> ShardingRules | None:
    """The rules `activate` made current (None outside a sharded model's tracing)."""
    return _ACTIVE.get()


def active_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the active rules' mesh, else of the default backend."""
    rules = active_rules()
    return next(iter(rules.mesh.devices.flat)).platform if rules is not None else jax.default_backend()
