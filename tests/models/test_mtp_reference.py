"""The MTP layer against transformers' own MTP implementation (`MtpModel`; `generate(..., use_mtp=True)`).

transformers looks for the MTP layer only at the released depth (61 for DeepSeek-V3, 46 for GLM-4.5), so the
checkpoints are tiny-width, full-depth, with the MTP tensors in the released key layout (per-expert keys under
`model.layers.{N}`); DeepSeek's carries the embedding / head copies, GLM's omits them (the trunk's are shared).
"""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

import mtp_jax
from mtp_jax.cli.score import main as score_main
from tests.support.moe_models import FAMILIES, MOE_SHAPE, RELEASED_DEPTH, save_with_mtp_layer

pytestmark = pytest.mark.slow

TOL = dict(atol=2e-5, rtol=2e-5)
SEQUENCES = np.random.default_rng(5).integers(0, MOE_SHAPE["vocab_size"], (2, 11))
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=FAMILIES)
def full_depth(request, tmp_path_factory):
    """(folder, transformers model, its MtpModel, our model) of one family at its released depth."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp(request.param)
    save_with_mtp_layer(request.param, folder, RELEASED_DEPTH[request.param], mtp_copies=request.param == "deepseek_v3")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    mtp = MtpModel.from_pretrained(hf)
    ours = mtp_jax.load_model(str(folder), dtype=jnp.float32)
    return folder, hf, mtp, ours


def hf_depth1_logits(hf, mtp, ids: np.ndarray) -> np.ndarray:
    """Teacher-forced depth-1 logits [1, T-1, V]: the MTP layer at p sees the trunk's final hidden at p and
    token p+1 (transformers numbers these positions from 1)."""
    tokens = torch.from_numpy(ids).long()
    with torch.no_grad():
        hidden = hf(tokens, output_hidden_states=True).hidden_states[-1]  # after the final norm
        positions = torch.arange(1, ids.shape[1])[None]
        out = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=tokens[:, 1:])
        return mtp._project_to_logits(out).numpy()


def test_config(full_depth):
    _, hf, _, ours = full_depth
    cfg = ours.config
    assert cfg.num_layers == RELEASED_DEPTH[cfg.family] and cfg.has_mtp and cfg.mtp.layout == "deepseek"
    assert not cfg.mtp.own_embedding and not cfg.mtp.own_head  # DeepSeek's copies equal the trunk's
    assert cfg.mtp_layer_kind.mlp == "moe" and hf.config.num_mtp_layers == 1


def test_depth1_logits(full_depth):
    _, hf, mtp, ours = full_depth
    ids = SEQUENCES[:1]
    width = ids.shape[1]
    positions = jnp.arange(width)[None]
    hidden, _ = ours.trunk(ids, positions, ours.new_cache(1, width))
    _, normed, _ = ours.mtp_step(hidden[:, :-1], ids[:, 1:], positions[:, :-1], ours.new_mtp_cache(1, width))
    chex.assert_trees_all_close(ours.draft_logits(normed), hf_depth1_logits(hf, mtp, ids), **TOL)


def test_score_cli_draft_argmax(full_depth, tmp_path, capsys):
    """`python -m mtp_jax.score`'s depth-1 argmax at every position equals transformers' MTP argmax."""
    folder, hf, mtp, _ = full_depth
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": row.tolist()}) + "\n" for row in SEQUENCES))
    code = score_main(["--model", str(folder), "--prompts-file", str(prompts), "--num-draft", "1",
                       "--out", str(tmp_path / "s.json"), "--dtype", "float32"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    draft_argmax = json.loads((tmp_path / "s.json").read_text())["draft_argmax"]
    for row, ids in enumerate(SEQUENCES):
        reference = hf_depth1_logits(hf, mtp, ids[None])[0].argmax(-1).tolist()
        assert draft_argmax[row] == reference, f"sequence {row}"


def test_greedy_with_mtp(full_depth):
    """transformers' MTP-assisted greedy generate (batch 1) and ours (k = 1) give the same tokens."""
    _, hf, _, ours = full_depth
    prompt = SEQUENCES[1, :6]
    ids = torch.from_numpy(prompt[None]).long()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0, use_mtp=True)  # fmt: skip
    reference = out[0, len(prompt) :].tolist()
    cfg = mtp_jax.DecodeConfig(num_draft=1, max_new_tokens=NEW_TOKENS)
    result = mtp_jax.generate(ours, prompt[None], np.array([len(prompt)]), jax.random.key(0), cfg)
    assert np.asarray(result.tokens[0]).tolist() == reference
