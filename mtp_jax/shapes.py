"""Named model shapes for timing random weights without a checkpoint (`python -m mtp_jax.bench --random-shape`)."""

from __future__ import annotations

from collections.abc import Callable

from mtp_jax.config import ModelConfig, MtpConfig, RopeConfig


def tiny() -> ModelConfig:
    """Test size (configs/tiny/llama-with-mtp-head.json): 2 layers, hidden 64, vocab 256, a DeepSeek-layout head."""
    return ModelConfig(
        family="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_ids=(2,),
        bos_token_id=1,
        mtp=MtpConfig(layout="deepseek"),
    )


def smollm2_135m() -> ModelConfig:
    """The default model's trunk (SmolLM2-135M-Instruct) plus one DeepSeek-layout MTP layer, as train_head adds."""
    return ModelConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0),
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        eos_token_ids=(2,),
        bos_token_id=1,
        mtp=MtpConfig(layout="deepseek"),
    )


def mimo_7b() -> ModelConfig:
    """MiMo-7B: a Qwen2 trunk (qkv bias, untied) with one MTP layer in MiMo's layout."""
    return ModelConfig(
        family="mimo",
        vocab_size=151680,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=640000.0),
        qkv_bias=True,
        max_position_embeddings=32768,
        eos_token_ids=(151643,),
        bos_token_id=151643,
        mtp=MtpConfig(layout="mimo"),
    )


SHAPES: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "smollm2-135m": smollm2_135m,
    "mimo-7b": mimo_7b,
}
