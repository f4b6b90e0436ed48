"""fp8 weights kept as the checkpoint ships them: float8 e4m3 values and their block scales stay in the model
(`--weights auto`), dequantized inside the jitted step.

Tiny DeepSeek-V3, GLM-4.5 and Qwen3.5 checkpoints with their MTP layers are written twice: every matmul weight as fp8
with random 8 x 8 block scales (the rest float32), and as those weights dequantized by hand, element by element
(tests/conversion/test_fp8.py's reference). Loaded with the fp8 kept, the model holds one float8 byte per quantized
weight; its logits equal the dequantized checkpoint's and transformers' on it; greedy MTP decoding equals plain
decoding.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import mtp_jax
from tests.support import hybrid_models
from tests.support.commands import cpu_env
from tests.support.fp8_checkpoints import PROMPT_LENS, logits_of, quantized_params, write_checkpoint, write_fp8_pair

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_5"])
def test_fp8_checkpoint_stays_fp8_and_decodes_as_dequantized(family, tmp_path):
    write_checkpoint(family, tmp_path / "float32")
    count = write_fp8_pair(tmp_path / "float32", tmp_path / "fp8", tmp_path / "dequantized")
    fp8 = mtp_jax.load_model(str(tmp_path / "fp8"), dtype=jnp.float32)
    dequantized = mtp_jax.load_model(str(tmp_path / "dequantized"), dtype=jnp.float32)

    kept = quantized_params(fp8)
    assert kept and not quantized_params(dequantized)
    if family == "deepseek_v3":  # --weights bfloat16 dequantizes on load; fp8 keeps the checkpoint's own choice
        assert not quantized_params(mtp_jax.load_model(str(tmp_path / "fp8"), dtype=jnp.float32, weights="bfloat16"))
        as_fp8 = mtp_jax.load_model(str(tmp_path / "fp8"), dtype=jnp.float32, weights="fp8")
        assert [q.shape for q in quantized_params(as_fp8)] == [q.shape for q in kept]
    assert all(q.values.dtype == jnp.float8_e4m3fn and q.scales.dtype == jnp.float32 for q in kept)
    # every fp8 tensor of the checkpoint is one slot of a kept parameter (layers and experts stack slots)
    slots = sum(int(np.prod(q.shape[: q.ndim - 2])) if q.ndim > 2 else 1 for q in kept)
    assert slots >= count // 4 and sum(q.values.size for q in kept) > 0

    vocab = fp8.config.vocab_size
    prompts = np.random.default_rng(3).integers(0, vocab, (len(PROMPT_LENS), PROMPT_LENS.max())).astype(np.int32)
    ours = logits_of(fp8, prompts)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, logits_of(dequantized, prompts), atol=1e-5, rtol=1e-5)
    if family not in hybrid_models.FAMILIES:  # transformers' model of the hand-dequantized weights
        reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = reference(torch.from_numpy(prompts).long()).logits.numpy()
        row = 0  # the longest prompt: no padding
        np.testing.assert_allclose(ours[row], theirs[row], atol=2e-4, rtol=2e-4)

    cfg = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=12, stop_on_eos=False)
    plain = mtp_jax.generate(fp8, prompts, PROMPT_LENS, jax.random.key(0), dataclasses.replace(cfg, num_draft=0))
    drafted = mtp_jax.generate(fp8, prompts, PROMPT_LENS, jax.random.key(0), cfg)
    np.testing.assert_array_equal(np.asarray(drafted.tokens), np.asarray(plain.tokens))


SHARDED_LOAD = """
import sys, json, jax, jax.numpy as jnp, numpy as np
import mtp_jax
from mtp_jax.parallel import sharding
from mtp_jax.quant.quantized_array import QuantizedArray
from flax import nnx
folder = sys.argv[1]
ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 7)), jnp.int32)
lens = jnp.array([7, 3, 5, 6], jnp.int32)
dc = mtp_jax.DecodeConfig(num_draft=2, max_new_tokens=10, stop_on_eos=False)
one = mtp_jax.load_model(folder, dtype=jnp.float32)
many = mtp_jax.load_model(folder, dtype=jnp.float32, mesh=sharding.make_mesh("data=2,expert=2,model=2"))
kept = [p.get_value() for _, p in nnx.iter_graph(many) if isinstance(p, nnx.Param)]
kept = [q for q in kept if isinstance(q, QuantizedArray)]
split = sum(not q.values.sharding.is_fully_replicated for q in kept)
tokens = [np.asarray(mtp_jax.generate(m, ids, lens, jax.random.key(0), dc).tokens).tolist() for m in (one, many)]
print(json.dumps({"kept": len(kept), "split": split, "tokens": tokens}))
"""


@pytest.mark.multidevice
def test_fp8_checkpoint_on_a_mesh_decodes_as_one_device(tmp_path):
    """The same fp8 DeepSeek-V3 checkpoint loaded onto 8 host devices (data=2,expert=2,model=2): every process
    reads the blocks of values and scales its devices hold; the values are split as their weights and greedy MTP
    tokens equal one device's."""
    write_checkpoint("deepseek_v3", tmp_path / "float32")
    write_fp8_pair(tmp_path / "float32", tmp_path / "fp8", tmp_path / "dequantized")
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", SHARDED_LOAD, str(tmp_path / "fp8")], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kept"] > 10 and report["split"] > 5
    assert report["tokens"][0] == report["tokens"][1]
