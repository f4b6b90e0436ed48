"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5 / 3.6): the layer, its cache, and the delta rule in its
chunked (prefill) and recurrent (decode / verify) forms.

Per token: one projection gives the conv channels (q, k, v), the output gate z, and per value head b and a. The
channels pass a causal depthwise conv (width W, state: the last W-1 inputs) and SiLU; q and k are L2-normalised
(q also scaled by H^-1/2); decay g = -exp(A_log) * softplus(a + dt_bias) (log space), beta = sigmoid(b). Each value
head n keeps a state S [H, Y] and reads key head n // G:

    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   out = S^T q

then the gated norm rmsnorm(out) * w * silu(z) and out_proj. The chunked form computes the same thing 64 tokens
at a time (a unit lower-triangular system within a chunk, solved by its inverse; one state update per chunk); the
recurrent form scans token by token. A verify block keeps its tokens' delta-rule inputs (`VerifiedBlock`), not a
state per position: once acceptance is known, each row's state is the state before the block replayed over its
accepted tokens, step for step as plain decoding computes it. A draft tree's block (models/block_tree.py) gives each
entry the state of a chain over its path from the root, and its conv the inputs of that path.

Einsum letters (with B, T, D of layers.py): C conv channels (q of every key head, then k, then v of every value
head), W conv width, K key heads, N value heads, G value heads per key head (N / K), H key head dim, Y value head
dim, I chunks, L and U positions within a chunk (query side, key side).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mtp_jax.config.model import GatedDeltaNetConfig
from mtp_jax.kernels import dispatch
from mtp_jax.kernels.dispatch import project
from mtp_jax.models.block_tree import BlockTree
from mtp_jax.models.layers import init_weight
from mtp_jax.models.norms import GatedRMSNorm
from mtp_jax.ops import loops
from mtp_jax.ops.rowwise import row_sum
from mtp_jax.parallel.sharding import DELTANET_BLOCK_INPUTS, HEAD_SCALARS, HEADS, constrain
from mtp_jax.quant.matmul_axes import MatmulAxes

CHUNK = 64  # tokens per chunk of the parallel form (as the HF reference)
L2_EPS = 1e-6  # q/k L2 norm: x * rsqrt(sum(x^2) + eps)


@struct.dataclass
class DeltaNetState:
    """What a gated DeltaNet layer needs to continue after the last token it saw.

    conv: [B, W-1, C] the last W-1 conv inputs (zeros before the first token), in the activation dtype.
    recurrent: [B, N, H, Y] float32, the delta-rule state of every value head.
    """

    conv: jax.Array
    recurrent: jax.Array

    @classmethod
    def zeros(cls, batch: int, cfg: GatedDeltaNetConfig, dtype) -> DeltaNetState:
        return cls(
            conv=jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
            recurrent=jnp.zeros((batch, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim), jnp.float32),
        )


@struct.dataclass
class VerifiedBlock:
    """A gated DeltaNet layer through a verify block of T tokens, until acceptance gives each row's length.

    inputs: [B, T, C] the block's conv inputs (the short conv's state after a position is the last W-1 inputs).
    k [B, T, N, H], v [B, T, N, Y], g, beta [B, T, N]: the block's delta-rule inputs, float32.
    A state per position would be [B, T, N, H, Y] (T recurrent states written, one read back); the inputs are
    T x (H + Y + 2) floats a head, and `kept` reads the state before the block once and writes the kept one.
    """

    inputs: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array

    def along(self, path: jax.Array) -> VerifiedBlock:
        """The block's entries path[b, j] ([B, P]) in path order: a draft tree's accepted path as a chain's block."""
        take = lambda a: jnp.take_along_axis(a, path.reshape(*path.shape, *(1,) * (a.ndim - 2)), axis=1)
        return jax.tree.map(take, self)

    def kept(self, before: DeltaNetState, accepted: jax.Array, active: jax.Array) -> DeltaNetState:
        """Each active row's state after block position accepted[b] ([B] int), from `before` (the state the block
        started from) advanced over its first accepted[b] + 1 tokens; rows not active ([B] bool) keep `before`
        exactly."""
        steps = jnp.where(active, accepted + 1, 0)
        _, recurrent = recurrent_delta_rule(None, self.k, self.v, self.g, self.beta, before.recurrent, steps)
        window = jnp.concatenate([before.conv, self.inputs.astype(before.conv.dtype)], axis=1)  # [B, W-1+T, C]
        conv = conv_states_after(window, steps[:, None], before.conv.shape[1])[:, 0]
        return DeltaNetState(conv=conv, recurrent=recurrent)


def causal_conv(
    x: jax.Array,  # [B, T, C] conv inputs of the new tokens
    conv_state: jax.Array,  # [B, W-1, C] the inputs before them
    weight: jax.Array,  # [W, C] depthwise taps, oldest input first
    tree: BlockTree | None = None,  # a draft tree's block: each token's taps follow its own path
) -> tuple[jax.Array, jax.Array]:
    """(SiLU(causal depthwise conv) [B, T, C], the whole input window [B, W-1+T, C]: state then new inputs)."""
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    width, t = weight.shape[0], x.shape[1]
    if tree is None:
        taps = [window[:, j : j + t] for j in range(width)]
    else:
        index = tree.conv_taps(width)  # [B, T, W]
        taps = [jnp.take_along_axis(window, index[..., j : j + 1], axis=1) for j in range(width)]
    out = sum(tap.astype(jnp.float32) * weight[j].astype(jnp.float32) for j, tap in enumerate(taps))
    return jax.nn.silu(out).astype(x.dtype), window


def conv_states_after(window: jax.Array, counts: jax.Array, state_len: int) -> jax.Array:
    """window [B, W-1+T, C] (state_len = W-1), counts [B, P] new tokens seen -> [B, P, W-1, C]: for each count, the
    last W-1 conv inputs once the first counts[b, p] new tokens are in."""
    rows = counts[:, :, None] + jnp.arange(state_len)  # [B, P, W-1] indices into the window
    return jnp.take_along_axis(window[:, None], rows[..., None], axis=2)


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(row_sum(x * x)[..., None] + L2_EPS)


def recurrent_delta_rule(
    q: jax.Array | None,  # [B, T, N, H] float32, normalised and scaled; None: no outputs
    k: jax.Array,  # [B, T, N, H] float32, normalised
    v: jax.Array,  # [B, T, N, Y] float32
    g: jax.Array,  # [B, T, N] float32 log decay (<= 0)
    beta: jax.Array,  # [B, T, N] float32
    state: jax.Array,  # [B, N, H, Y] float32
    steps: jax.Array | None = None,  # [B] int: tokens each row takes (the rest leave its state as it is); None: T
    final: bool = True,  # whether the state after the tokens is wanted
) -> tuple[jax.Array | None, jax.Array | None]:
    """Token by token: (outputs [B, T, N, Y], None without q; the state after each row's tokens [B, N, H, Y], None
    without `final`). A token a row takes is computed as in a block without `steps`, so a replay over a row's
    accepted tokens gives the state plain steps give. The kernel runs it where the execution plan says
    (kernels/delta_rule_kernel.py: TPU); XLA's scan elsewhere."""
    kernel = dispatch.delta_rule_implementation(k, state)
    if kernel is not None:
        return kernel(q, k, v, g, beta, state, steps, final)

    def step(s, token):
        index, q_t, k_t, v_t, g_t, beta_t = token  # [], [B, N, H], [B, N, H], [B, N, Y], [B, N], [B, N]
        new = s * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("BNHY,BNH->BNY", new, k_t)
        new = new + jnp.einsum("BNH,BNY->BNHY", k_t, (v_t - predicted) * beta_t[..., None])
        if steps is not None:
            new = jnp.where((index < steps)[:, None, None, None], new, s)
        return new, None if q_t is None else jnp.einsum("BNHY,BNH->BNY", new, q_t)

    time_major = [None if a is None else jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)]
    state, out = loops.scan(step, state, (jnp.arange(k.shape[1]), *time_major))
    return (None if out is None else jnp.moveaxis(out, 0, 1)), (state if final else None)


def tree_delta_rule(q, k, v, g, beta, state: jax.Array, tree: BlockTree) -> jax.Array:
    """Outputs [B, T, N, Y] over a draft tree's block (inputs [B, T, ...] as `recurrent_delta_rule` takes them, state
    [B, N, H, Y] before the block): each entry's with the state a chain over its path from the root reaches, every
    entry's path replayed at once as the rows of one recurrence (D+1 steps at most; a state per entry in flight,
    none kept: `VerifiedBlock.along` gives the accepted path's inputs to `kept`). The plan's kernel computes each
    entry once from its parent's state (kernels/delta_rule_kernel.py: TPU)."""
    kernel = dispatch.delta_rule_implementation(k, state)
    if kernel is not None:
        return kernel(q, k, v, g, beta, state, None, False, tree.parents)[0]
    b, t = k.shape[:2]
    steps = tree.depth + 1
    rows = lambda a: tree.along_paths(a).reshape(b * t, steps, *a.shape[2:])  # [B*T, D+1, ...]
    starts = jnp.repeat(state, t, axis=0)  # [B*T, N, H, Y]
    taken = (tree.depths + 1).reshape(b * t)
    out, _ = recurrent_delta_rule(rows(q), rows(k), rows(v), rows(g), rows(beta), starts, taken, final=False)
    out = out.reshape(b, t, steps, *out.shape[2:])  # [B, T, D+1, N, Y]
    return jnp.take_along_axis(out, tree.depths[:, :, None, None, None], axis=2)[:, :, 0]


_EXACT = jax.lax.Precision.HIGHEST  # float32 matmuls in full precision (not TF32 / bf16 passes) on GPU and TPU


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(1 + strictly_lower(a))^-1 for a [..., L, L], in matmuls only, by doubling the diagonal blocks it inverts:
    with D the blocks of size s and E the lower-left s-block inside each 2s-block, E D^-1 E = 0, so
    (D + E)^-1 = D^-1 - D^-1 E D^-1. Starts from the identity (blocks of size 1); log2(L) steps.

    (Rather than lax.linalg.triangular_solve: on CPU that is LAPACK's strsm, whose batch threads wait on XLA's
    intra-op pool; two solves in flight at once fill a two-thread pool and wait on each other for ever.)"""
    size = a.shape[-1]
    rows = jnp.arange(size)
    inverse = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), a.shape)
    block = 1
    while block < size:
        same_pair = rows[:, None] // (2 * block) == rows[None, :] // (2 * block)
        lower_left = ((rows[:, None] // block) % 2 == 1) & ((rows[None, :] // block) % 2 == 0) & same_pair
        joining = jnp.where(lower_left, a, 0)  # [..., L, L]
        inverse = inverse - jnp.matmul(inverse, jnp.matmul(joining, inverse, precision=_EXACT), precision=_EXACT)
        block *= 2
    return inverse


def chunked_delta_rule(
    q: jax.Array,  # [B, T, N, H] float32, normalised and scaled
    k: jax.Array,  # [B, T, N, H] float32, normalised
    v: jax.Array,  # [B, T, N, Y] float32
    g: jax.Array,  # [B, T, N] float32 log decay (<= 0); 0 with beta 0 leaves the state untouched
    beta: jax.Array,  # [B, T, N] float32
    state: jax.Array,  # [B, N, H, Y] float32
) -> tuple[jax.Array, jax.Array]:
    """CHUNK tokens at a time (any T: zero-padded to whole chunks; T < CHUNK: one chunk of T): (outputs
    [B, T, N, Y], final state [B, N, H, Y]).

    Within a chunk, with cumulative log decay c and D[l, u] = exp(c_l - c_u) for u <= l (0 above): the delta rule's
    corrections solve (1 + strictly_lower(beta_l k_l.k_u D)) X = [beta v | beta k exp(c)], so that each chunk needs
    one read of the state before it and one update after it.
    """
    b, t, n = q.shape[:3]
    size = min(CHUNK, t)  # a block shorter than CHUNK is one chunk of its own length
    pad = -t % size
    chunks = (t + pad) // size

    def to_chunks(a: jax.Array) -> jax.Array:  # [B, T, N, ...] -> [B, N, I, L, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, chunks, size, *a.shape[2:])
        return jnp.moveaxis(a, 3, 1)

    q, k, v, g, beta = (to_chunks(a) for a in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [B, N, I, L]
    causal = jnp.tril(jnp.ones((size, size), bool))  # [L, U]
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [B, N, I, L, U]

    inverse = unit_lower_inverse(jnp.einsum("BNILH,BNIUH->BNILU", k_beta, k) * decay)  # [B, N, I, L, U]
    new_values = jnp.einsum("BNILU,BNIUY->BNILY", inverse, v_beta, precision=_EXACT)
    key_reads = jnp.einsum(  # how much of the state each token reads
        "BNILU,BNIUH->BNILH", inverse, k_beta * jnp.exp(cum)[..., None], precision=_EXACT
    )
    intra = jnp.einsum("BNILH,BNIUH->BNILU", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, N, I]

    def step(s, chunk):
        new_v, reads, q_c, k_c, intra_c, decay_c = chunk
        corrections = new_v - jnp.einsum("BNLH,BNHY->BNLY", reads, s)
        out = jnp.einsum("BNLH,BNHY->BNLY", q_c, s) + jnp.einsum("BNLU,BNUY->BNLY", intra_c, corrections)
        s = s * decay_c[..., None, None] + jnp.einsum("BNLH,BNLY->BNHY", k_c, corrections)
        return s, out

    per_chunk = [jnp.moveaxis(a, 2, 0) for a in (new_values, key_reads, q_decayed, k_decayed, intra, chunk_decay)]
    state, out = jax.lax.scan(step, state, per_chunk)  # out [I, B, N, L, Y]
    out = jnp.moveaxis(out, 0, 2).reshape(b, n, chunks * size, -1)[:, :, :t]
    return jnp.moveaxis(out, 1, 2), state


class GatedDeltaNet(nnx.Module):
    """The gated DeltaNet token mixer (HF: `linear_attn`), in the canonical parameter layout: the checkpoints'
    fused or split input projections are reordered into it on conversion
    (mtp_jax/families/qwen_hybrid_layout.py)."""

    def __init__(self, cfg: GatedDeltaNetConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs | None):
        d, c, n, y = hidden_size, cfg.conv_dim, cfg.num_value_heads, cfg.value_head_dim
        self.cfg = cfg
        # the q, k, v channel projection is split like an MLP width (the short conv then gathers the step's
        # [B, T, C] channels, which the conv state and weight keep whole); the per-value-head ones over heads
        by_d = MatmulAxes((0,))  # products over D
        self.in_proj_qkv = nnx.Param(init_weight(rngs, (d, c), dtype, d), axes=("embed", "mlp"), matmul=by_d)  # DC
        z = init_weight(rngs, (d, n, y), dtype, d)
        self.in_proj_z = nnx.Param(z, axes=("embed", "heads", None), matmul=by_d)  # DNY
        self.in_proj_b = nnx.Param(init_weight(rngs, (d, n), dtype, d), axes=("embed", "heads"), matmul=by_d)  # DN
        self.in_proj_a = nnx.Param(init_weight(rngs, (d, n), dtype, d), axes=("embed", "heads"), matmul=by_d)  # DN
        conv = init_weight(rngs, (cfg.conv_kernel, c), dtype, cfg.conv_kernel)
        self.conv = nnx.Param(conv, axes=(None, None))  # WC
        self.dt_bias = nnx.Param(jnp.ones((n,), dtype), axes=("heads",))  # [N]
        self.A_log = nnx.Param(jnp.zeros((n,), dtype), axes=("heads",))  # [N] decay rate log(A)
        self.norm = GatedRMSNorm(y, cfg.norm_eps, dtype=dtype)
        out = init_weight(rngs, (n, y, d), dtype, n * y)
        self.out_proj = nnx.Param(out, axes=("heads", None, "embed"), matmul=MatmulAxes((0, 1)))  # NYD: over N, Y

    def _rule_inputs(self, x: jax.Array, state: DeltaNetState, tree: BlockTree | None = None):
        """x [B, T, D] -> (q, k, v, g, beta float32 as the delta rule takes them, z [B, T, N, Y], conv window)."""
        cfg = self.cfg
        channels = project("BTD,DC->BTC", x, self.in_proj_qkv.get_value())
        mixed, window = causal_conv(channels, state.conv, self.conv[...], tree)
        b, t, _ = mixed.shape
        q, k, v = jnp.split(mixed.astype(jnp.float32), [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        groups = cfg.num_value_heads // cfg.num_key_heads
        q, k = (jnp.repeat(a.reshape(b, t, cfg.num_key_heads, -1), groups, axis=2) for a in (q, k))  # [B,T,N,H]
        q = l2_normalize(q) / math.sqrt(cfg.key_head_dim)
        k = l2_normalize(k)
        v = v.reshape(b, t, cfg.num_value_heads, cfg.value_head_dim)
        a = project("BTD,DN->BTN", x, self.in_proj_a.get_value()).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        beta = jax.nn.sigmoid(project("BTD,DN->BTN", x, self.in_proj_b.get_value())).astype(jnp.float32)
        z = project("BTD,DNY->BTNY", x, self.in_proj_z.get_value())
        return q, k, v, g, beta, z, window

    def _output(self, core: jax.Array, z: jax.Array, dtype) -> jax.Array:
        """core [B, T, N, Y] float32, z [B, T, N, Y] -> [B, T, D]."""
        gated = self.norm(core.astype(dtype), z)
        return project("BTNY,NYD->BTD", gated, self.out_proj.get_value())

    def prefill(
        self,
        x: jax.Array,  # [B, T, D]
        state: DeltaNetState,  # before these tokens
        lengths: jax.Array | None = None,  # [B] valid tokens per right-padded row; None: all T
    ) -> tuple[jax.Array, DeltaNetState]:
        """Chunked form: (output [B, T, D], each row's state after its last valid token). Padding tokens leave the
        state untouched (beta = g = 0); their outputs are meaningless."""
        with jax.named_scope("gated_deltanet"):
            q, k, v, g, beta, z, window = self._rule_inputs(x, state)
            b, t = x.shape[:2]
            lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
            valid = (jnp.arange(t) < lengths[:, None])[..., None]  # [B, T, 1]
            core, recurrent = chunked_delta_rule(
                q, k, v, jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0), state.recurrent
            )
            conv = conv_states_after(window, lengths[:, None], self.cfg.conv_kernel - 1)[:, 0]
            new_state = DeltaNetState(conv=conv.astype(state.conv.dtype), recurrent=recurrent)
            return self._output(core, z, x.dtype), new_state

    def verify(
        self, x: jax.Array, state: DeltaNetState, every_position: bool, tree: BlockTree | None = None
    ) -> tuple[jax.Array, DeltaNetState | VerifiedBlock]:
        """Recurrent form over a short block x [B, T, D]: (output [B, T, D], the state after the block, or with
        `every_position` what `VerifiedBlock.kept` needs to give the state after any of its positions). A draft
        tree's block (`tree`, with `every_position`): each entry as the last token of a chain over its path."""
        with jax.named_scope("gated_deltanet"):
            q, k, v, g, beta, z, window = self._rule_inputs(x, state, tree)
            if tree is None:
                core, recurrent = recurrent_delta_rule(q, k, v, g, beta, state.recurrent, final=not every_position)
            else:
                core = tree_delta_rule(q, k, v, g, beta, state.recurrent, tree)
            b, t = x.shape[:2]
            width = self.cfg.conv_kernel - 1
            output = self._output(core, z, x.dtype)
            if every_position:  # kept as laid out here: only the state each row keeps is gathered to the cache's
                inputs = constrain(window[:, width:], DELTANET_BLOCK_INPUTS)
                k, v = constrain(k, HEADS), constrain(v, HEADS)
                g, beta = constrain(g, HEAD_SCALARS), constrain(beta, HEAD_SCALARS)
                return output, VerifiedBlock(inputs=inputs, k=k, v=v, g=g, beta=beta)
            conv = conv_states_after(window, jnp.full((b, 1), t), width)[:, 0]
            return output, DeltaNetState(conv=conv.astype(state.conv.dtype), recurrent=recurrent)
