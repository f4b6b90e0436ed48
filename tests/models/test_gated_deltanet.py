"""The gated DeltaNet layer (Qwen3-Next fused projections, Qwen3.5 split ones) against transformers' PyTorch modules
on tiny random configs, float32: the chunked and recurrent delta rules against transformers' reference functions,
the whole layer without a cache, cached decode token by token (outputs and conv / recurrent states), the per-position
states of a verify block, a draft tree's block (each node against torch decoding its path token by token),
continuing a prefill, and right-padded prefill rows."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from mtp_jax.families import qwen_hybrid_layout as layout
from mtp_jax.models.block_tree import BlockTree
from mtp_jax.models.gated_deltanet import (
    CHUNK,
    DeltaNetState,
    GatedDeltaNet,
    GatedDeltaNetConfig,
    VerifiedBlock,
    chunked_delta_rule,
    l2_normalize,
    recurrent_delta_rule,
    unit_lower_inverse,
)
from mtp_jax.params.transforms import DepthwiseConv
from tests.support.parity_helpers import normal_inputs, state_dict_numpy, to_numpy

TOL = dict(rtol=1e-4, atol=1e-5)
HIDDEN = 32
# qwen3_next: 2 value heads per key head, conv width 4; qwen3_5: 3 value heads per key head, conv width 3.
SHAPES = {
    "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=6, linear_conv_kernel_dim=4),
    "qwen3_5": dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=4,
                    linear_value_head_dim=8, linear_conv_kernel_dim=3),
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def _hf_config(family: str):
    common = dict(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=16, intermediate_size=16, rms_norm_eps=1e-6,
    )  # fmt: skip
    if family == "qwen3_next":
        return Qwen3NextConfig(**common, **SHAPES[family], num_experts=0)
    return Qwen3_5TextConfig(**common, **SHAPES[family])


def _ours(hf_layer: torch.nn.Module, cfg: GatedDeltaNetConfig, family: str) -> GatedDeltaNet:
    """Our layer holding the torch layer's weights, through the converter's layout functions."""
    sd = state_dict_numpy(hf_layer)
    ours = GatedDeltaNet(cfg, HIDDEN, dtype=jnp.float32, rngs=None)
    if family == "qwen3_next":
        qkv, z = layout.fused_qkvz(sd["in_proj_qkvz.weight"], cfg)
        b, a = layout.fused_ba(sd["in_proj_ba.weight"], cfg)
    else:
        qkv, z = sd["in_proj_qkv.weight"].T, layout.split_z(sd["in_proj_z.weight"], cfg)
        b, a = sd["in_proj_b.weight"].T, sd["in_proj_a.weight"].T
    values = {
        "in_proj_qkv": qkv, "in_proj_z": z, "in_proj_b": b, "in_proj_a": a,
        "conv": DepthwiseConv()(sd["conv1d.weight"], None), "out_proj": layout.out_proj(sd["out_proj.weight"], cfg),
        "dt_bias": sd["dt_bias"], "A_log": sd["A_log"],
    }  # fmt: skip
    for name, value in values.items():
        getattr(ours, name)[...] = jnp.asarray(value)
    ours.norm.scale[...] = jnp.asarray(sd["norm.weight"])
    return ours


@pytest.fixture(scope="module", params=sorted(SHAPES))
def layers(request):
    """(transformers' config, its layer with random weights, ours with the same weights, our config)."""
    family = request.param
    hf_cfg = _hf_config(family)
    torch.manual_seed(0)
    hf_layer = (hf_next.Qwen3NextGatedDeltaNet if family == "qwen3_next" else Qwen3_5GatedDeltaNet)(hf_cfg, 0)
    with torch.no_grad():
        for p in hf_layer.parameters():
            p.normal_(0.0, 0.3)
        hf_layer.A_log.uniform_(-2.0, 1.0)  # decays from mild to strong
    cfg = GatedDeltaNetConfig(
        num_key_heads=hf_cfg.linear_num_key_heads,
        num_value_heads=hf_cfg.linear_num_value_heads,
        key_head_dim=hf_cfg.linear_key_head_dim,
        value_head_dim=hf_cfg.linear_value_head_dim,
        conv_kernel=hf_cfg.linear_conv_kernel_dim,
        norm_eps=hf_cfg.rms_norm_eps,
    )
    return hf_cfg, hf_layer.eval(), _ours(hf_layer, cfg, family), cfg


def _j(t: torch.Tensor) -> jnp.ndarray:
    return jnp.asarray(to_numpy(t))


def _close(ours, ref, **tol) -> None:
    ref = to_numpy(ref) if isinstance(ref, torch.Tensor) else ref
    np.testing.assert_allclose(np.asarray(ours), ref, **(tol or TOL))


@nnx.jit
def _prefill(layer: GatedDeltaNet, x, state, lengths):
    return layer.prefill(x, state, lengths)


@nnx.jit(static_argnums=3)
def _verify(layer: GatedDeltaNet, x, state, every_position: bool):
    return layer.verify(x, state, every_position)


@nnx.jit
def _verify_tree(layer: GatedDeltaNet, x, state, tree: BlockTree):
    return layer.verify(x, state, True, tree)


@jax.jit
def _kept(block: VerifiedBlock, before: DeltaNetState, accepted, active):
    return block.kept(before, accepted, active)


def _hf_state(cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cached (conv [B, C, W] -> our [B, W-1, C], recurrent [B, N, H, Y]) of layer 0."""
    return cache.get_conv_state(0)[..., 1:].transpose(1, 2), cache.get_recurrent_state(0)


@pytest.mark.parametrize("size", [1, 4, 13, CHUNK])
def test_unit_lower_inverse_matches_numpy(size):
    """Block-doubling inverse of 1 + strictly_lower(a) against numpy's, over sizes that are and are not powers of
    two; what lies on and above the diagonal of a is never read."""
    a = np.random.default_rng(size).uniform(-0.5, 0.5, size=(3, size, size)).astype(np.float32)
    expected = np.linalg.inv(np.eye(size) + np.tril(a.astype(np.float64), -1))
    _close(jax.jit(unit_lower_inverse)(jnp.asarray(a)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_delta_rules_match_transformers_references():
    """Both rules from a nonzero state over 2.2 chunks, grouped heads (3 value heads per key head)."""
    rng = np.random.default_rng(1)
    b, t, k, n, h, y = 2, 2 * CHUNK + 13, 2, 6, 8, 5
    q, key = (torch.from_numpy(rng.normal(size=(b, t, k, h)).astype(np.float32)) for _ in range(2))
    v = torch.from_numpy(rng.normal(size=(b, t, n, y)).astype(np.float32))
    g = torch.from_numpy(-rng.uniform(0.0, 0.5, size=(b, t, n)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0.0, 1.0, size=(b, t, n)).astype(np.float32))
    state = torch.from_numpy(rng.normal(size=(b, n, h, y)).astype(np.float32))
    args = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    chunk_out, chunk_state = hf_next.torch_chunk_gated_delta_rule(q, key, v, g=g, beta=beta, **args)
    step_out, step_state = hf_next.torch_recurrent_gated_delta_rule(q, key, v, g=g, beta=beta, **args)

    q_ours, k_ours = (jnp.repeat(l2_normalize(_j(a)), n // k, axis=2) for a in (q, key))
    rule_args = (q_ours / np.sqrt(h), k_ours, _j(v), _j(g), _j(beta), _j(state))
    out, final = jax.jit(chunked_delta_rule)(*rule_args)
    _close(out, chunk_out)
    _close(final, chunk_state)
    out, final = jax.jit(recurrent_delta_rule)(*rule_args)
    _close(out, step_out)
    _close(final, step_state)
    _close(out, chunk_out)  # the two forms agree with each other as well


@pytest.mark.slow
def test_prefill_decode_and_verify_states(layers):
    """transformers with its cache: prefill 70 tokens (a chunk, then a padded one), then 4 tokens one at a time.
    Ours: the same prefill (chunked), then the 4 tokens as one verify block (recurrent): its outputs, its last state,
    and the state replayed to each position equal torch's per step; a row that is done keeps its old state exactly,
    and replaying the whole block gives the block's own last state bit for bit. Continuing a prefill with the 4
    tokens, and one prefill of all 74, end where torch does."""
    hf_cfg, hf_layer, ours, cfg = layers
    prompt, block = CHUNK + 6, 4
    x = normal_inputs(3, (2, prompt + block, HIDDEN))
    cache = DynamicCache(config=hf_cfg)
    ref_states, ref_outs = [], []
    with torch.no_grad():
        ref_prefill = hf_layer(x[:, :prompt], cache_params=cache)
        prefill_state = [s.clone() for s in _hf_state(cache)]
        for i in range(prompt, prompt + block):
            ref_outs.append(hf_layer(x[:, i : i + 1], cache_params=cache))
            ref_states.append([s.clone() for s in _hf_state(cache)])
    ref_block = torch.cat(ref_outs, dim=1)

    zeros = DeltaNetState.zeros(2, cfg, jnp.float32)
    out, state = _prefill(ours, _j(x[:, :prompt]), zeros, jnp.array([prompt, prompt]))
    _close(out, ref_prefill)
    _close(state.conv, prefill_state[0])
    _close(state.recurrent, prefill_state[1])

    out, last = _verify(ours, _j(x[:, prompt:]), state, False)
    _close(out, ref_block)
    _close(last.conv, ref_states[-1][0])
    _close(last.recurrent, ref_states[-1][1])
    out, block_inputs = _verify(ours, _j(x[:, prompt:]), state, True)
    _close(out, ref_block)
    assert block_inputs.inputs.shape == (2, block, cfg.conv_dim)
    both = jnp.array([True, True])
    for i, (conv, recurrent) in enumerate(ref_states):  # the state after each position, replayed
        kept = _kept(block_inputs, state, jnp.array([i, i]), both)
        _close(kept.conv, conv)
        _close(kept.recurrent, recurrent)
    np.testing.assert_array_equal(  # the whole block replayed is the block's own last state, bit for bit
        np.asarray(_kept(block_inputs, state, jnp.array([block - 1] * 2), both).recurrent), np.asarray(last.recurrent)
    )

    accepted = jnp.array([1, 3])  # row 0 keeps the state after 2 tokens; row 1 is done and keeps the old one
    kept = _kept(block_inputs, state, accepted, jnp.array([True, False]))
    _close(kept.recurrent[0], ref_states[1][1][0])
    _close(kept.conv[0], ref_states[1][0][0])
    np.testing.assert_array_equal(np.asarray(kept.recurrent[1]), np.asarray(state.recurrent[1]))
    np.testing.assert_array_equal(np.asarray(kept.conv[1]), np.asarray(state.conv[1]))

    continued_out, continued = _prefill(ours, _j(x[:, prompt:]), state, jnp.array([block, block]))
    _close(continued_out, ref_block)
    _close(continued.conv, ref_states[-1][0])
    _close(continued.recurrent, ref_states[-1][1])
    whole_out, whole = _prefill(ours, _j(x), zeros, jnp.array([prompt + block] * 2))
    _close(whole_out[:, -block:], ref_block)
    _close(whole.conv, ref_states[-1][0])
    _close(whole.recurrent, ref_states[-1][1])


@pytest.mark.slow
def test_right_padded_prefill_keeps_each_rows_state(layers):
    """Rows of 2 and 4 valid tokens padded to 4 (2 is shorter than the conv state): each row's state is torch's
    after its own tokens only."""
    hf_cfg, hf_layer, ours, cfg = layers
    lengths = (2, 4)
    x = normal_inputs(4, (2, max(lengths), HIDDEN))
    _, state = _prefill(ours, _j(x), DeltaNetState.zeros(2, cfg, jnp.float32), jnp.array(lengths))
    for row, length in enumerate(lengths):
        cache = DynamicCache(config=hf_cfg)
        with torch.no_grad():
            hf_layer(x[row : row + 1, :length], cache_params=cache)
        conv, recurrent = _hf_state(cache)
        _close(state.conv[row], conv[0])
        _close(state.recurrent[row], recurrent[0])


# A tree of 8 entries, 3 deep: the root's children 1 and 2, 1's children 3 and 4, 2's child 5, 4's child 6, 3's
# child 7 (entry 0, the root, names itself).
TREE_PARENTS = (0, 0, 0, 1, 1, 2, 4, 3)


def _path(entry: int) -> list[int]:
    path = [entry]
    while path[-1]:
        path.append(TREE_PARENTS[path[-1]])
    return path[::-1]


@pytest.mark.slow
def test_a_draft_trees_block_is_each_nodes_path_decoded(layers):
    """After a prefill of 9 tokens (torch's cache and ours), a tree block: each entry's output is torch's output at
    the last token of its path from the root decoded token by token, and the state kept along an accepted path
    (`VerifiedBlock.along`, then `kept`) is torch's after that path, the conv state included (paths shorter and
    longer than the conv window)."""
    hf_cfg, hf_layer, ours, cfg = layers
    prompt, entries = 9, len(TREE_PARENTS)
    x = normal_inputs(5, (2, prompt + entries, HIDDEN))
    cache = DynamicCache(config=hf_cfg)
    with torch.no_grad():
        hf_layer(x[:, :prompt], cache_params=cache)
    _, state = _prefill(ours, _j(x[:, :prompt]), DeltaNetState.zeros(2, cfg, jnp.float32), jnp.array([prompt] * 2))
    parents = jnp.broadcast_to(jnp.array(TREE_PARENTS, jnp.int32), (2, entries))
    tree = BlockTree.of(parents, 3)
    out, block = _verify_tree(ours, _j(x[:, prompt:]), state, tree)
    both = jnp.array([True, True])
    for entry in range(entries):
        path = _path(entry)
        walk = copy.deepcopy(cache)
        with torch.no_grad():
            for node in path:
                ref_out = hf_layer(x[:, prompt + node : prompt + node + 1], cache_params=walk)
        _close(out[:, entry], ref_out[:, 0])
        padded = jnp.array(path + [0] * (4 - len(path)), jnp.int32)
        kept = _kept(block.along(jnp.broadcast_to(padded, (2, 4))), state, jnp.array([len(path) - 1] * 2), both)
        conv, recurrent = _hf_state(walk)
        _close(kept.conv, conv)
        _close(kept.recurrent, recurrent)


def test_block_tree_paths_and_conv_taps_follow_each_entrys_ancestors():
    """`BlockTree.of` against a walk up the parents, per row (row 1 a chain): each entry's depth, its ancestors (the
    mask), its path by depth; and the conv taps of a chain are a causal conv's (window offsets t .. t + W-1)."""
    chain = tuple(max(i - 1, 0) for i in range(len(TREE_PARENTS)))
    parents = jnp.array([TREE_PARENTS, chain], jnp.int32)
    tree = BlockTree.of(parents, len(TREE_PARENTS) - 1)
    width = 4
    taps = np.asarray(tree.conv_taps(width))
    for row, row_parents in enumerate((TREE_PARENTS, chain)):
        for entry in range(len(row_parents)):
            path = [entry]
            while path[-1]:
                path.append(row_parents[path[-1]])
            path = path[::-1]
            assert tree.depths[row, entry] == len(path) - 1
            np.testing.assert_array_equal(np.flatnonzero(np.asarray(tree.mask[row, entry])), sorted(path))
            np.testing.assert_array_equal(np.asarray(tree.paths[row, entry, : len(path)]), path)
            window = [*range(width - 1), *(width - 1 + p for p in path)]  # the state's inputs, then the path's
            np.testing.assert_array_equal(taps[row, entry], window[-width:])
    np.testing.assert_array_equal(taps[1], np.arange(len(chain))[:, None] + np.arange(width))
