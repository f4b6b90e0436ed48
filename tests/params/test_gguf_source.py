"""GGUFSource: tiny synthetic GGUFs for layout, names and errors; the real SmolLM2 GGUF vs transformers."""

from __future__ import annotations

import os
import re

import gguf
import ml_dtypes
import numpy as np
import pytest

from mtp_jax.params.gguf_source import GGUFSource
from mtp_jax.params.open_source import open_source
from mtp_jax.runtime.errors import ConversionError

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 32, 4, 2, 64, 16
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_row_order(w: np.ndarray, num_heads: int) -> np.ndarray:
    """q/k rows as llama.cpp's convert script writes them: per head, HF row j*head_dim/2 + i -> row 2i + j."""
    out = np.empty_like(w)
    head_dim = w.shape[0] // num_heads
    half = head_dim // 2
    for h in range(num_heads):
        for i in range(half):
            for j in range(2):
                out[h * head_dim + 2 * i + j] = w[h * head_dim + j * half + i]
    return out


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray], rope_scaling=None) -> str:
    """A one-layer GGUF of `tensors` (arrays, or (raw array, GGML type) pairs) with minimal metadata."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(rope_scaling)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture
def hf_weights() -> dict[str, np.ndarray]:
    """Random one-layer weights under HF names, [out, in] layout."""
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def llama_file(tmp_path, hf: dict[str, np.ndarray]) -> str:
    """A llama GGUF holding `hf` the way llama.cpp writes it (q/k rows reordered)."""
    layer = "model.layers.0."
    return write_gguf(
        tmp_path / "tiny-llama.gguf",
        "llama",
        {
            "token_embd.weight": hf["model.embed_tokens.weight"],
            "output_norm.weight": hf["model.norm.weight"],
            "blk.0.attn_norm.weight": hf[layer + "input_layernorm.weight"],
            "blk.0.attn_q.weight": llama_cpp_row_order(hf[layer + "self_attn.q_proj.weight"], HEADS),
            "blk.0.attn_k.weight": llama_cpp_row_order(hf[layer + "self_attn.k_proj.weight"], KV_HEADS),
            "blk.0.attn_v.weight": hf[layer + "self_attn.v_proj.weight"].astype(np.float16),
            "blk.0.attn_output.weight": (
                hf[layer + "self_attn.o_proj.weight"].astype(ml_dtypes.bfloat16).view(np.uint16),
                Q.BF16,
            ),
            "blk.0.ffn_down.weight": (
                gguf.quants.quantize(hf[layer + "mlp.down_proj.weight"], Q.Q8_0),
                Q.Q8_0,
            ),
            "blk.0.exotic.weight": np.zeros(3, np.float32),
        },
    )


def test_llama_names_dtypes_and_layout(tmp_path, hf_weights):
    source = open_source(llama_file(tmp_path, hf_weights))
    assert isinstance(source, GGUFSource)
    layer = "model.layers.0."
    assert set(source.tensor_names()) == (set(hf_weights) | {"gguf:blk.0.exotic.weight"})
    for name in source.tensor_names():
        assert source.read(name).shape == source.shape(name)
    for name in (
        "model.embed_tokens.weight",
        layer + "self_attn.q_proj.weight",
        layer + "self_attn.k_proj.weight",
    ):
        got = source.read(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, hf_weights[name])
    v = source.read(layer + "self_attn.v_proj.weight")
    assert v.dtype == np.float16
    np.testing.assert_array_equal(v, hf_weights[layer + "self_attn.v_proj.weight"].astype(np.float16))
    o = source.read(layer + "self_attn.o_proj.weight")
    assert o.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(o, hf_weights[layer + "self_attn.o_proj.weight"].astype(ml_dtypes.bfloat16))
    down = source.read(layer + "mlp.down_proj.weight")
    assert down.dtype == np.float32
    np.testing.assert_allclose(down, hf_weights[layer + "mlp.down_proj.weight"], atol=0.05)


def rope_rotate_half(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF RoPE on one head x [D]: element i pairs with element i + D/2."""
    half = x.shape[0] // 2
    angle = pos * theta ** (-np.arange(half) * 2 / x.shape[0])
    cos, sin = np.tile(np.cos(angle), 2), np.tile(np.sin(angle), 2)
    return x * cos + np.concatenate([-x[half:], x[:half]]) * sin


def rope_interleaved(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp's RoPE for llama on one head x [D]: element 2i pairs with element 2i + 1."""
    angle = pos * theta ** (-np.arange(x.shape[0] // 2) * 2 / x.shape[0])
    even, odd = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2] = even * np.cos(angle) - odd * np.sin(angle)
    out[1::2] = even * np.sin(angle) + odd * np.cos(angle)
    return out


def test_llama_unpermuted_q_k_give_the_same_attention_scores_under_hf_rope(tmp_path, hf_weights):
    """The file's rows with llama.cpp RoPE and `read`'s rows with HF RoPE score every query/key pair alike."""
    path = llama_file(tmp_path, hf_weights)
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    source = GGUFSource(path)
    theta = source.hf_config["rope_theta"]
    x_q, x_k = np.random.default_rng(1).standard_normal((2, HIDDEN))
    q_file = (raw["blk.0.attn_q.weight"] @ x_q).reshape(HEADS, HEAD_DIM)
    k_file = (raw["blk.0.attn_k.weight"] @ x_k).reshape(KV_HEADS, HEAD_DIM)
    q_hf = (source.read("model.layers.0.self_attn.q_proj.weight") @ x_q).reshape(HEADS, HEAD_DIM)
    k_hf = (source.read("model.layers.0.self_attn.k_proj.weight") @ x_k).reshape(KV_HEADS, HEAD_DIM)
    assert not np.allclose(q_file, q_hf)
    for h in range(HEADS):
        g = h // (HEADS // KV_HEADS)
        for m, n in ((0, 0), (5, 2), (17, 11)):
            file_score = rope_interleaved(q_file[h], m, theta) @ rope_interleaved(k_file[g], n, theta)
            hf_score = rope_rotate_half(q_hf[h], m, theta) @ rope_rotate_half(k_hf[g], n, theta)
            np.testing.assert_allclose(hf_score, file_score, rtol=1e-4, atol=1e-4)


def test_llama_config(tmp_path, hf_weights):
    config = GGUFSource(llama_file(tmp_path, hf_weights)).hf_config
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": pytest.approx(1e-6),
        "rope_theta": 50000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def test_qwen2_keeps_q_k_rows_and_maps_biases(tmp_path):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    q_bias = rng.standard_normal(HEADS * HEAD_DIM).astype(np.float32)
    lm_head = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    path = write_gguf(
        tmp_path / "tiny-qwen2.gguf",
        "qwen2",
        {"blk.0.attn_q.weight": q, "blk.0.attn_q.bias": q_bias, "output.weight": lm_head},
    )
    source = GGUFSource(path)
    np.testing.assert_array_equal(source.read("model.layers.0.self_attn.q_proj.weight"), q)
    np.testing.assert_array_equal(source.read("model.layers.0.self_attn.q_proj.bias"), q_bias)
    np.testing.assert_array_equal(source.read("lm_head.weight"), lm_head)
    config = source.hf_config
    assert config["model_type"] == "qwen2"
    assert config["attention_bias"] is True
    assert config["tie_word_embeddings"] is False


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "falcon.gguf", "falcon", {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ConversionError, match=re.escape("'falcon' is not supported (supported: llama, qwen2, qwen3)")):
        GGUFSource(path)


def test_rope_scaling_is_refused(tmp_path):
    path = write_gguf(
        tmp_path / "scaled.gguf",
        "llama",
        {"token_embd.weight": np.zeros((4, 4), np.float32)},
        rope_scaling=gguf.RopeScalingType.LINEAR,
    )
    with pytest.raises(ConversionError, match="rope scaling 'linear'"):
        GGUFSource(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConversionError, match=r"garbage\.gguf: corrupt or truncated GGUF"):
        GGUFSource(str(path))


# The real default model against transformers' own GGUF loader.


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> GGUFSource:
    return GGUFSource(smollm2_path)


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2, hf_model):
    expected = {name: t.numpy() for name, t in hf_model.state_dict().items()}
    assert smollm2.hf_config["tie_word_embeddings"]
    expected.pop("lm_head.weight")  # tied: transformers lists the embedding twice
    assert set(smollm2.tensor_names()) == set(expected)
    for name in smollm2.tensor_names():
        got = smollm2.read(name)
        assert got.shape == smollm2.shape(name) == expected[name].shape, name
        np.testing.assert_allclose(got, expected[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2, hf_model):
    config = smollm2.hf_config
    hf = hf_model.config
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "hidden_act",
        "attention_bias",
    ):
        assert config[key] == getattr(hf, key), key
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"]


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    tokenizer = smollm2.load_tokenizer()
    text = "Speculative decoding, with multi-token heads: naïve → fast!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == smollm2.hf_config["eos_token_id"]
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_truncated_smollm2_is_refused(smollm2_path, tmp_path):
    truncated = tmp_path / "half.gguf"
    with open(smollm2_path, "rb") as f:
        truncated.write_bytes(f.read(os.path.getsize(smollm2_path) // 2))
    with pytest.raises(ConversionError, match=r"half\.gguf: (corrupt or )?truncated GGUF"):
        GGUFSource(str(truncated))


@pytest.mark.slow
def test_torch_free_tokenizer_equals_transformers_gguf_tokenizer(smollm2, smollm2_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm2_path)
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ours = smollm2.load_tokenizer()
    for text in ["Hello world, this is a test.", "  leading spaces\nand ünïcödé — 123", "def f(x):\n    return x**2"]:
        assert ours(text)["input_ids"] == reference(text)["input_ids"]
    chat = [{"role": "user", "content": "What is JAX?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) == reference.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True
    )
