"""Named model shapes for timing random weights without a checkpoint (`python -m mtp_jax.bench --random-shape`)."""

from __future__ import annotations

from collections.abc import Callable

from mtp_jax.config import GatedDeltaNetConfig, MlaConfig, ModelConfig, MoeConfig, MtpConfig, RopeConfig


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


def deepseek_v3_tiny() -> ModelConfig:
    """Test size (configs/tiny/deepseek_v3.json): 3 layers (1 dense, 2 with 16 routed experts, top-4 of 2 groups
    of the 4), MLA with query LoRA, yarn rotary, a DeepSeek MTP layer with experts."""
    return ModelConfig(
        family="deepseek_v3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        rope=RopeConfig(
            kind="yarn", factor=4.0, original_max_position_embeddings=128, mscale_all_dim=1.0, interleaved=True
        ),
        max_position_embeddings=512,
        eos_token_ids=(2,),
        bos_token_id=1,
        mtp=MtpConfig(layout="deepseek"),
        mla=MlaConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48),
        moe=MoeConfig(
            num_experts=16,
            experts_per_token=4,
            expert_intermediate_size=32,
            num_shared_experts=1,
            num_groups=4,
            topk_groups=2,
            routed_scaling_factor=2.5,
            first_dense_layers=1,
        ),
    )


def deepseek_v3_slice() -> ModelConfig:
    """DeepSeek-V3 at real width, 2 layers deep (the first dense, the second with all 256 routed experts) plus its
    MTP layer (256 experts too): about 25B parameters, 50 GB in bfloat16 — for an 80 GB accelerator."""
    return ModelConfig(
        family="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=2,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        rope=RopeConfig(
            kind="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale_all_dim=1.0,
            interleaved=True,
        ),
        max_position_embeddings=163840,
        eos_token_ids=(1,),
        bos_token_id=0,
        mtp=MtpConfig(layout="deepseek"),
        mla=MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
        moe=MoeConfig(
            num_experts=256,
            experts_per_token=8,
            expert_intermediate_size=2048,
            num_shared_experts=1,
            num_groups=8,
            topk_groups=4,
            routed_scaling_factor=2.5,
            first_dense_layers=1,
        ),
    )


def _qwen_hybrid(num_layers: int, **shape) -> ModelConfig:
    """A Qwen3.5 / 3.6 dense hybrid trunk: 3 gated DeltaNet layers then 1 gated attention layer, repeated."""
    linear = shape.pop("linear")
    return ModelConfig(
        family="qwen3_5",
        num_layers=num_layers,
        rope=RopeConfig(theta=10_000_000.0, partial_factor=0.25),
        mtp=MtpConfig(layout="qwen_next", recurse_normed=True),
        linear_attention=linear,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)),
        gated_attention=True,
        zero_centered_norms=True,
        **shape,
    )


def qwen3_5_tiny() -> ModelConfig:
    """Test size (configs/tiny/qwen3_5.json has 4 layers, 2 groups of 2): 8 layers, 2 groups of (3 DeltaNet, 1
    gated attention), hidden 64, vocab 256, its MTP layer."""
    return _qwen_hybrid(
        8,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        eos_token_ids=(2,),
        tie_word_embeddings=True,
        linear=GatedDeltaNetConfig(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16),
    )


def qwen3_6_27b_slice() -> ModelConfig:
    """Qwen3.6-27B (= Qwen3.5-27B's shape) at real width, 8 of its 64 layers (2 groups of 3 DeltaNet + 1 gated
    attention) plus its MTP layer: about 6.0B parameters, 12 GB in bfloat16."""
    return _qwen_hybrid(
        8,
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_heads=24,
        num_kv_heads=4,
        head_dim=256,
        max_position_embeddings=262144,
        eos_token_ids=(248044,),
        linear=GatedDeltaNetConfig(num_key_heads=16, num_value_heads=48, key_head_dim=128, value_head_dim=128),
    )


SHAPES: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "smollm2-135m": smollm2_135m,
    "mimo-7b": mimo_7b,
    "deepseek-v3-tiny": deepseek_v3_tiny,
    "deepseek-v3-slice": deepseek_v3_slice,
    "qwen3.5-tiny": qwen3_5_tiny,
    "qwen3.6-27b-slice": qwen3_6_27b_slice,
}
