"""MTP-head training: K recursive teacher-forced steps through one shared MTP layer; trunk, embedding and lm_head
frozen.

Step k (1-based) at slot s predicts x[s+2] from the token x[s+1] and a hidden: the trunk's h[s] for k = 1, and for
k > 1 step k-1's output at slot s-1. So the chain started at t reaches slot t+k-1 at step k and predicts x[t+k+1]
from h[t] and the true tokens x[t+1..t+k] — the recursion a decode round runs. Loss weights
alpha_k = beta^(k-1) / sum_j beta^(j-1).

Three objectives: "ce", cross-entropy on the token x[s+2]; "kl", KL(p || q) from the trunk's own next-token
distribution p at slot s+1 (over the draft vocabulary, renormalized) to the draft distribution q; "tv", the total
variation 1 - sum_x min(p(x), q(x)) between the same two. The last two give every position a whole distribution to
match instead of one token; "tv" is one minus the probability that sampled verification at temperature 1 accepts the
draft, so it trains for exactly that. The benchmarks log compares them on the default model
(docs/benchmarks-log.md#head-objective-cross-entropy-on-tokens-vs-kl-to-the-trunk-cpu and the head's stages after
it).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx, struct

from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.models.layers import model_norm
from mtp_jax.quant.quantized_array import QuantizedArray, dense


def loss_weights(num_steps: int, beta: float = 0.6) -> np.ndarray:
    """[K] weights beta^(k-1) / sum_j beta^(j-1): [0.51, 0.31, 0.18] for K = 3."""
    raw = beta ** np.arange(num_steps, dtype=np.float64)
    return (raw / raw.sum()).astype(np.float32)


@struct.dataclass
class Batch:
    tokens: jax.Array  # [B, T] int32, right-padded
    hidden: jax.Array  # [B, T, D] the frozen trunk's final-normed hidden
    lengths: jax.Array  # [B] valid tokens per row
    loss_start: jax.Array  # [B] first target position that counts (the response start)
    taps: jax.Array | None = None  # [B, T, N, D] the outputs of the head's `fused_layers` (None: it fuses none)


def draft_hidden(model: CausalLM, batch: Batch) -> jax.Array:
    """[B, T, D] the hidden the MTP layer reads at each slot: the trunk's final one, or its fusion with the outputs
    of the head's `fused_layers` (`MtpModule.fuse`, trained with the head)."""
    return batch.hidden if batch.taps is None else model.mtp.fuse(batch.hidden, batch.taps)


def step_logits(model: CausalLM, tokens: jax.Array, hidden: jax.Array, num_steps: int,
                training_time_test: bool = False) -> list[jax.Array]:  # fmt: skip
    """Draft-vocabulary logits [B, T, Vd] of each step; at every step slot s predicts x[s+2]. Step k > 1 runs the
    MTP block over step k - 1's outputs at every slot, so its attention sees recursed states where a decode round's
    draft sees the MTP layer's states over the true hiddens; `training_time_test`: as a round does
    (`step_logits_ttt`)."""
    if training_time_test:
        return step_logits_ttt(model, tokens, hidden, num_steps)
    batch_size, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch_size, width))
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch_size, 1), tokens.dtype)], axis=1)  # x[s+1]
    logits = []
    for _ in range(num_steps):
        cache = model.new_mtp_cache(batch_size, 1)  # a full-sequence pass, no past
        recurse, normed, _ = model.mtp_step(hidden, next_tokens, positions, cache)
        logits.append(model.draft_logits(normed))
        hidden = jnp.concatenate([jnp.zeros_like(recurse[:, :1]), recurse[:, :-1]], axis=1)  # slot s <- s-1
    return logits


def ttt_mask(depth: int, width: int) -> np.ndarray:
    """[depth W, depth W] bool: which entries of a training-time-test block each sees. Entry (i, s) (index (i-1) W +
    s) is depth i's draft at slot s, of the chain started at t = s - i + 1. As a decode round drafts it, it sees the
    MTP cache over the true hiddens up to the chain's start (depth 1's entries at slots <= t) and the chain's own
    drafts (depth m's entry at slot t + m - 1 for m = 2..i, itself the last)."""
    i = np.repeat(np.arange(1, depth + 1), width)[:, None]  # [D W, 1] each entry's depth
    s = np.tile(np.arange(width), depth)[:, None]  # its slot
    m, u = i.T, s.T  # [1, D W]: the seen entry's depth and slot
    start = s - i + 1
    return ((m == 1) & (u <= start)) | ((m >= 2) & (m <= i) & (u == start + m - 1))


def step_logits_ttt(model: CausalLM, tokens: jax.Array, hidden: jax.Array, num_steps: int) -> list[jax.Array]:
    """`step_logits` with training-time test (EAGLE-3): each step's drafts attend as a decode round's do, to the MTP
    layer's states over the true hiddens up to their chain's start and to their chain's own earlier drafts, not to
    other chains' recursed states. Step k runs the MTP block over the entries of depths 1..k at once (`ttt_mask`),
    the deeper ones' hiddens the outputs of the step before, one slot back."""
    batch_size, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch_size, width))
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch_size, 1), tokens.dtype)], axis=1)  # x[s+1]
    inputs, logits = [hidden], []
    for step in range(1, num_steps + 1):
        mask = jnp.broadcast_to(jnp.asarray(ttt_mask(step, width)), (batch_size, step * width, step * width))
        cache = model.new_mtp_cache(batch_size, 1)  # a full-sequence pass, no past
        recurse, normed, _ = model.mtp_step(jnp.concatenate(inputs, axis=1), jnp.tile(next_tokens, (1, step)),
                                            jnp.tile(positions, (1, step)), cache, block_mask=mask)  # fmt: skip
        logits.append(model.draft_logits(normed[:, -width:]))
        deepest = recurse[:, -width:]
        inputs.append(jnp.concatenate([jnp.zeros_like(deepest[:, :1]), deepest[:, :-1]], axis=1))  # slot s <- s-1
    return logits


def trunk_draft_log_probs(model: CausalLM, hidden: jax.Array) -> jax.Array:
    """Log-probabilities [B, T, Vd] of the trunk's next token from its final-normed hidden [B, T, D], over the draft
    vocabulary (renormalized there): what a perfect draft would propose."""
    weights = model.head_weights()  # [D, V]: the trunk's lm_head, also when the MTP layer has its own
    if model.draft_vocab is not None:
        weights = jnp.take(weights, model.draft_vocab[...], axis=1)  # [D, Vd]
    logits = jnp.einsum("btd,dv->btv", hidden, weights, preferred_element_type=jnp.float32)
    return jax.nn.log_softmax(jax.lax.stop_gradient(logits), axis=-1)


def step_losses(model: CausalLM, batch: Batch, num_steps: int, target_index: jax.Array, objective: str = "ce",
                training_time_test: bool = False):  # fmt: skip
    """Per-step (mean loss [K], argmax accuracy [K], counted slots [K]).

    objective "ce": cross-entropy on x[s+2]; target_index [V] maps a token id to its index in the draft vocabulary
    (-1 outside it; those targets are not counted: drafts cannot propose them). "kl": KL(p || q) from the trunk's
    distribution at slot s+1 (the one that picked x[s+2]) to the draft's, at every slot; "tv": their total variation
    1 - sum min(p, q). Accuracy counts argmax matches of x[s+2] either way.
    """
    tokens, (batch_size, width) = batch.tokens, batch.tokens.shape
    slots = jnp.arange(width)
    targets = jnp.concatenate([tokens[:, 2:], jnp.zeros((batch_size, 2), tokens.dtype)], axis=1)  # x[s+2]
    target_draft = target_index[targets]  # [B, T]
    in_text = (slots + 2 < batch.lengths[:, None]) & (slots + 2 >= batch.loss_start[:, None])
    if objective == "ce":
        in_text &= target_draft >= 0
    elif objective in ("kl", "tv"):
        next_hidden = jnp.concatenate([batch.hidden[:, 1:], jnp.zeros_like(batch.hidden[:, :1])], axis=1)  # h[s+1]
        teacher = trunk_draft_log_probs(model, next_hidden)  # [B, T, Vd]
    else:
        raise ValueError(f"unknown objective {objective!r}; known: ce, kl, tv")
    safe_target = jnp.maximum(target_draft, 0)
    losses, accuracies, counts = [], [], []
    step_inputs = draft_hidden(model, batch)
    for step, logits in enumerate(step_logits(model, tokens, step_inputs, num_steps, training_time_test)):
        log_q = jax.nn.log_softmax(logits, axis=-1)  # [B, T, Vd]
        if objective == "ce":
            loss = -jnp.take_along_axis(log_q, safe_target[..., None], -1)[..., 0]
        elif objective == "kl":
            loss = jnp.sum(jnp.exp(teacher) * (teacher - log_q), axis=-1)
        else:
            loss = 1.0 - jnp.sum(jnp.minimum(jnp.exp(teacher), jnp.exp(log_q)), axis=-1)
        valid = in_text & (slots >= step)[None, :]  # the chain must have started at slot s - step >= 0
        count = jnp.sum(valid)
        losses.append(jnp.sum(jnp.where(valid, loss, 0.0)) / jnp.maximum(count, 1))
        accuracies.append(jnp.sum(valid & (jnp.argmax(logits, -1) == target_draft)) / jnp.maximum(count, 1))
        counts.append(count)
    return jnp.stack(losses), jnp.stack(accuracies), jnp.stack(counts)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    num_steps: int = 3  # K recursive MTP steps in the objective
    objective: str = "ce"  # "ce" on the next-next token, "kl" or "tv" to the trunk's distribution (module docstring)
    training_time_test: bool = False  # deeper steps attend as a decode round's drafts do (`step_logits_ttt`)
    beta: float = 0.6
    train_steps: int = 1000
    batch_size: int = 16
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    grad_clip: float = 1.0
    weight_decay: float = 0.01
    seed: int = 0

    def optimizer(self) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=min(self.warmup_steps, max(self.train_steps - 1, 1)),
            decay_steps=max(self.train_steps, 2),
            end_value=self.learning_rate * self.final_lr_fraction,
        )
        return optax.chain(
            optax.clip_by_global_norm(self.grad_clip), optax.adamw(schedule, weight_decay=self.weight_decay)
        )


def split_trainable(model: CausalLM):
    """(graphdef, trainable MTP state, frozen rest)."""
    return nnx.split(model, nnx.PathContains("mtp"), ...)


def draft_target_index(model: CausalLM) -> jax.Array:
    """[V] int32: index of each token in the draft vocabulary, -1 when outside it."""
    vocab = model.config.vocab_size
    if model.draft_vocab is None:
        return jnp.arange(vocab, dtype=jnp.int32)
    return (
        jnp.full((vocab,), -1, jnp.int32)
        .at[model.draft_vocab[...]]
        .set(jnp.arange(model.draft_vocab.shape[0], dtype=jnp.int32))
    )


class Trainer:
    """Holds the jitted train step (compiled once per batch shape) and the optimizer for one model."""

    def __init__(self, model: CausalLM, cfg: TrainConfig):
        self.cfg = cfg
        self.graphdef, params, self.frozen = split_trainable(model)
        self.params = jax.tree.map(jnp.copy, params)  # owned: donation must not free buffers the caller shares
        self.optimizer = cfg.optimizer()
        self.opt_state = self.optimizer.init(self.params)
        self.step = 0
        self.weights = jnp.asarray(loss_weights(cfg.num_steps, cfg.beta))
        self.target_index = draft_target_index(model)
        self._train_step = jax.jit(self._step_fn, donate_argnums=(0, 1))

    def _step_fn(self, params, opt_state, frozen, batch: Batch):
        def objective(params):
            model = nnx.merge(self.graphdef, params, frozen)
            losses, accuracies, counts = step_losses(
                model, batch, self.cfg.num_steps, self.target_index, self.cfg.objective, self.cfg.training_time_test
            )
            return jnp.sum(self.weights * losses), (losses, accuracies, counts)

        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        metrics = {"loss": loss, **dict(zip(("ce", "acc", "n"), aux, strict=True))}
        return optax.apply_updates(params, updates), opt_state, metrics

    def train_step(self, batch: Batch) -> dict:
        self.params, self.opt_state, metrics = self._train_step(self.params, self.opt_state, self.frozen, batch)
        self.step += 1
        return metrics

    def model(self) -> CausalLM:
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def nonfinite(self) -> list[str]:
        """The trainable parameters holding a NaN or an infinity (a diverged run), by path."""
        flat = nnx.to_flat_state(self.params)
        return ["/".join(map(str, path)) for path, var in flat if not bool(jnp.all(jnp.isfinite(var[...])))]

    # Checkpoints: params and optimizer state as flat leaf lists (restored into this trainer's structures).
    def save(self, directory: str) -> None:

        state = {"params": jax.tree.leaves(self.params), "opt": jax.tree.leaves(self.opt_state)}
        with ocp.CheckpointManager(os.path.abspath(directory), options=_manager_options()) as manager:
            manager.save(self.step, args=ocp.args.StandardSave(state))
            manager.wait_until_finished()

    def restore(self, directory: str) -> bool:
        """Restore the latest checkpoint in `directory`; False when there is none."""

        with ocp.CheckpointManager(os.path.abspath(directory), options=_manager_options()) as manager:
            step = manager.latest_step()
            if step is None:
                return False
            target = {"params": jax.tree.leaves(self.params), "opt": jax.tree.leaves(self.opt_state)}
            state = manager.restore(step, args=ocp.args.StandardRestore(target))
        self.params = jax.tree.unflatten(jax.tree.structure(self.params), state["params"])
        self.opt_state = jax.tree.unflatten(jax.tree.structure(self.opt_state), state["opt"])
        self.step = step
        return True


def _manager_options():

    # A save cut short by a kill stays a temporary folder (never a checkpoint); the next manager removes it.
    return ocp.CheckpointManagerOptions(max_to_keep=2, create=True, cleanup_tmp_directories=True)


def frequent_tokens(records: list[dict], vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent response tokens of the data (ties by id), sorted by id: a draft vocabulary."""
    counts = np.zeros(vocab_size, np.int64)
    for record in records:
        response = record["token_ids"][record.get("prompt_len", 0) :]
        np.add.at(counts, np.asarray(response, np.int64), 1)
    ranked = np.lexsort((np.arange(vocab_size), -counts))[:size]
    return np.sort(ranked).astype(np.int32)


def init_head_from_trunk(model: CausalLM, key: jax.Array) -> None:
    """Start the MTP block's L layers from the trunk's last L (of the trunk's last segment: the MTP layer's kind;
    weights the trunk holds quantized start the head dequantized, in the model's dtype: a head trains in floats),
    its final norm from the trunk's, the fusion projection random (std 1/sqrt(2D)), fusion norms at one; fused
    features (`fused_layers`) start as the final hidden alone (their projection [I; 0; ..; 0])."""
    count = model.config.mtp.block_layers
    is_quantized = lambda a: isinstance(a, QuantizedArray)
    last = jax.tree.map(lambda a: dense(a)[-count:], nnx.state(model.segments[-1].layers), is_leaf=is_quantized)
    nnx.update(model.mtp.block.layers, last)
    model.mtp.final_norm.scale[...] = jnp.copy(model.final_norm.scale[...])
    d = model.config.hidden_size
    model.mtp.proj[...] = (jax.random.normal(key, (2 * d, d)) / np.sqrt(2 * d)).astype(model.mtp.proj.dtype)
    model.mtp.token_norm.scale[...] = jnp.ones_like(model.mtp.token_norm.scale[...])
    model.mtp.hidden_norm.scale[...] = jnp.ones_like(model.mtp.hidden_norm.scale[...])
    if model.mtp.feature_proj is not None:
        model.mtp.feature_norm.scale[...] = model_norm(model.config, d, dtype=model.dtype).scale[...]
        features = model.mtp.feature_proj.shape[0]
        model.mtp.feature_proj[...] = jnp.eye(features, d, dtype=model.mtp.feature_proj.dtype)  # [(N+1) D, D]


# A decoder layer with these at zero adds nothing to its residual stream: the identity.
RESIDUAL_OUTPUTS = ("o_proj", "o_bias", "down_proj", "down_bias", "expert_down")


def grow_head(model: CausalLM, head: nnx.State) -> None:
    """Give `model` (its head just built by `init_head_from_trunk`) the MTP parameters `head` holds, for a block of
    fewer layers: `head`'s layers come first, and each added one keeps its start from the trunk with its residual
    outputs at zero, so the grown head drafts exactly as `head` did until training moves them."""
    current = dict(nnx.to_flat_state(nnx.state(model, nnx.PathContains("mtp"))))
    updates = []
    for path, var in nnx.to_flat_state(head):
        value = var[...]
        if path[:3] == ("mtp", "block", "layers"):
            grown = current[path][...]  # [L, ...] against the kept head's [L0, ...]
            if path[-1] in RESIDUAL_OUTPUTS:
                grown = jnp.zeros_like(grown)
            value = grown.at[: value.shape[0]].set(value)
        updates.append((path, var.replace(value)))
    nnx.update(model, nnx.from_flat_state(updates))
