"""MTP self-speculative decoding in JAX/Flax."""

from mtp_jax.checkpoint import load_model
from mtp_jax.config import DecodeConfig, ModelConfig, MtpConfig, RopeConfig
from mtp_jax.models.causal_lm import CausalLM, unstack_layers
from mtp_jax.sampling import SamplingParams
from mtp_jax.speculative import GenerateOutput, generate

__all__ = [
    "CausalLM",
    "DecodeConfig",
    "GenerateOutput",
    "ModelConfig",
    "MtpConfig",
    "RopeConfig",
    "SamplingParams",
    "generate",
    "load_model",
    "unstack_layers",
]
