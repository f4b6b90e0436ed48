"""The gated DeltaNet's delta rule token by token, on TPU: a Pallas kernel that keeps each head's state in VMEM
across the block's tokens.

XLA computes a decode step's or verify block's delta rule (models/gated_deltanet.py, `recurrent_delta_rule`) as
one or two fusions per token, each reading and writing the float32 state [N, H, Y] of every row: for a verify block
of T tokens about 2T passes over the states, and the replay that keeps each row's state after its accepted tokens
(`VerifiedBlock.kept`) as many again. The states are most of what a hybrid trunk's decode moves besides weights
(Qwen3.5-397B-A17B at batch 8: 45 DeltaNet layers of 32 MiB of states a chip). This kernel reads a row's states
once and writes them at most once, whatever T:

  - the grid runs over rows and tiles of heads; a step holds its heads' states [N', H, Y], the block's keys and
    queries [N', T, H] (transposed in VMEM into columns), values [N', T, Y] and per-head decay and beta (lanes 0
    and 1 of [N', T, LANES]); T is a whole block dimension, so none of these is padded in HBM (a plain step's
    [B, 1, N, H] keys are the kernel's [B, N, 1, H] as they lie);
  - per head and token, in float32 on the vector units: s <- exp(g) s; s <- s + k ((v - k^T s) beta); out = s^T q
    (the recurrence of `recurrent_delta_rule`, as sums over H rather than matmuls);
  - a row takes its first steps[b] tokens (a scalar-prefetch argument) and keeps its state for the rest: the
    replay of a verify block over each row's accepted tokens is the same kernel without outputs;
  - `final`: whether the state after the tokens is written back (a verify block's is not: its rows keep the state
    their replay gives).
A plain step, a verify block and a replay all run this code, so on a TPU they compute every state alike, as plain
decoding and MTP decoding must (XLA's scan is the same for all three elsewhere). Under a mesh of several devices the
call runs per shard (`jax.shard_map`) over the layouts the model pins: rows over `batch`, heads over `heads`.
Einsum letters as models/gated_deltanet.py's: B rows, T tokens, N value heads, H key dim, Y value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mtp_jax.kernels import traced_plan
from mtp_jax.parallel import sharding

KERNEL_NAME = "mtp_jax_delta_rule"  # in the compiled program's custom call
LANES = 128
STATE_BLOCK_BYTES = 2 * 2**20  # a grid step's states at most (each is fetched and written back double-buffered)
STATE = ("batch", "heads", None, None)  # [B, N, H, Y]
ROWS = ("batch",)  # [B]
TREE = ("batch", None)  # [B, T]


def head_tile(heads: int, h: int, y: int) -> int:
    """N': the most heads whose float32 states fit STATE_BLOCK_BYTES and divide N (at least one)."""
    fitting = [n for n in range(1, heads + 1) if heads % n == 0 and n * h * y * 4 <= STATE_BLOCK_BYTES]
    return max(fitting, default=1)


def _body(tokens: int, outputs: bool, final: bool, tree: bool, steps_ref, parents_ref, *refs):
    state_ref, k_ref, v_ref, scalars_ref, *rest = refs
    q_ref = rest.pop(0) if outputs else None
    out_ref = rest.pop(0) if outputs else None
    new_ref = rest.pop(0) if final else None
    nodes_ref = rest.pop(0) if tree else None  # [T, H, Y] VMEM: each tree entry's state
    row = pl.program_id(0)
    steps = steps_ref[row]

    def head(n, carry):
        s = state_ref[0, n]  # [H, Y]
        k_columns = k_ref[0, n].T  # [H, T]
        q_columns = q_ref[0, n].T if outputs else None
        v_rows, scalars = v_ref[0, n], scalars_ref[0, n]  # [T, Y], [T, LANES]
        outs = []
        for t in range(tokens):
            g, beta = scalars[t : t + 1, 0:1], scalars[t : t + 1, 1:2]  # [1, 1]
            k = k_columns[:, t : t + 1]  # [H, 1]
            before = nodes_ref[parents_ref[row, t]] if tree and t else s  # a tree entry continues its parent's
            new = before * jnp.exp(g)
            predicted = jnp.sum(new * k, axis=0, keepdims=True)  # [1, Y]
            new = new + k * ((v_rows[t : t + 1] - predicted) * beta)
            if tree:
                nodes_ref[t] = new
            s = new if tree else jnp.where(t < steps, new, s)
            if outputs:
                outs.append(jnp.sum(s * q_columns[:, t : t + 1], axis=0, keepdims=True))  # [1, Y]
        if outputs:
            out_ref[0, n] = jnp.concatenate(outs)  # [T, Y]
        if final:
            new_ref[0, n] = s
        return carry

    jax.lax.fori_loop(0, state_ref.shape[1], head, 0)


def delta_rule_kernel(
    q: jax.Array | None,  # [B, T, N, H] float32; None: no outputs
    k: jax.Array,  # [B, T, N, H]
    v: jax.Array,  # [B, T, N, Y]
    g: jax.Array,  # [B, T, N]
    beta: jax.Array,  # [B, T, N]
    state: jax.Array,  # [B, N, H, Y] float32
    steps: jax.Array | None = None,  # [B] int: tokens each row takes; None: all T
    final: bool = True,
    interpret: bool = False,
    parents: jax.Array | None = None,  # [B, T] int: a draft tree's block, each entry's parent (the root's: itself)
) -> tuple[jax.Array | None, jax.Array | None]:
    """(outputs [B, T, N, Y] or None without q, the state after each row's tokens [B, N, H, Y] or None without
    `final`), as `recurrent_delta_rule`'s, on one device's arrays. `interpret`: Pallas' interpreter. With
    `parents` (outputs, no state): each entry's output with its state continuing its parent's, the states of the
    tree's entries held in VMEM (`tree_delta_rule`'s, read once)."""
    b, t, n, h = k.shape
    y = v.shape[-1]
    heads = head_tile(n, h, y)
    by_head = lambda a: jnp.moveaxis(a, 1, 2)  # [B, T, N, X] -> [B, N, T, X]

    scalars = jnp.pad(jnp.stack([g, beta], axis=-1), ((0, 0), (0, 0), (0, 0), (0, LANES - 2)))  # [B, T, N, LANES]
    operands = [state, by_head(k), by_head(v), by_head(scalars)] + ([by_head(q)] if q is not None else [])
    tree = parents is not None
    if tree and (q is None or final):
        raise ValueError("a tree block's delta rule gives outputs and no state")
    block = lambda width: pl.BlockSpec((1, heads, t, width), lambda i, j, *prefetched: (i, j, 0, 0))
    state_block = pl.BlockSpec((1, heads, h, y), lambda i, j, *prefetched: (i, j, 0, 0))
    outputs = [(block(y), (b, n, t, y))] if q is not None else []
    outputs += [(state_block, (b, n, h, y))] if final else []
    if not outputs:
        return None, None
    in_bytes = 4 * heads * (h * y + max(t, 8) * (2 * h + y + LANES))  # VMEM rounds T up to whole sublanes
    in_bytes += 4 * t * h * y if tree else 0
    call = pl.pallas_call(
        functools.partial(_body, t, q is not None, final, tree),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, n // heads),
            in_specs=[state_block, block(h), block(y), block(LANES)] + ([block(h)] if q is not None else []),
            out_specs=[spec for spec, _ in outputs],
            scratch_shapes=[pltpu.VMEM((t, h, y), jnp.float32)] if tree else [],
        ),
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for _, shape in outputs],
        input_output_aliases={2: len(outputs) - 1} if final else {},  # the state written over the one read
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=4 * in_bytes + 16 * 2**20
        ),
        interpret=interpret,
        name=KERNEL_NAME,
    )
    steps = jnp.full((b,), t, jnp.int32) if steps is None else steps.astype(jnp.int32)
    parents = jnp.zeros((b, t), jnp.int32) if parents is None else parents.astype(jnp.int32)
    results = call(steps, parents, *operands)  # [outputs [B, N, T, Y]], [state [B, N, H, Y]]
    out = jnp.moveaxis(results[0], 1, 2) if q is not None else None
    return out, results[-1] if final else None


def _sharded(q, k, v, g, beta, state, steps, parents, final: bool, interpret: bool):
    """`delta_rule_kernel` per shard of the active mesh (a custom call is not split by XLA's partitioner)."""
    rules = sharding.active_rules()
    if rules is None or sharding.one_device_active():
        return delta_rule_kernel(q, k, v, g, beta, state, steps, final, interpret, parents)
    heads, scalars = sharding.HEADS, sharding.HEAD_SCALARS
    with_q, tree = q is not None, parents is not None
    args = (k, v, g, beta, state, steps) + ((q,) if with_q else ()) + ((parents,) if tree else ())
    layouts = (heads, heads, scalars, scalars, STATE, ROWS) + ((heads,) if with_q else ()) + ((TREE,) if tree else ())
    results = ((heads, v),) * with_q + ((STATE, state),) * final  # (layout, an array of the result's shape)

    def local(k, v, g, beta, state, steps, *rest):
        q = rest[0] if with_q else None
        out, new = delta_rule_kernel(q, k, v, g, beta, state, steps, final, interpret, rest[-1] if tree else None)
        return tuple(a for a in (out, new) if a is not None)

    spec = lambda logical, a: rules.sharding(logical, a.shape).spec
    mapped = jax.shard_map(
        local,
        mesh=rules.mesh,
        in_specs=tuple(spec(logical, a) for logical, a in zip(layouts, args, strict=True)),
        out_specs=tuple(spec(logical, a) for logical, a in results),
        check_vma=False,
    )
    found = list(mapped(*args))
    return (found.pop(0) if with_q else None), (found.pop(0) if final else None)


def fits(k: jax.Array, state: jax.Array) -> bool:
    """Whether Mosaic lays these heads out as the kernel reads them: key and value dims whole lanes."""
    h, y = state.shape[-2:]
    return h % LANES == 0 and y % LANES == 0 and k.shape[-1] == h


def run(q, k, v, g, beta, state, steps, final, parents=None) -> tuple[jax.Array | None, jax.Array | None]:
    """The delta rule by `delta_rule_kernel` (Pallas' interpreter off a TPU: a test's plan), split over a mesh's
    heads."""
    interpret = traced_plan.current().platform != "tpu"
    steps = jnp.full(k.shape[:1], k.shape[1], jnp.int32) if steps is None else steps.astype(jnp.int32)
    return _sharded(q, k, v, g, beta, state, steps, parents, final, interpret)
