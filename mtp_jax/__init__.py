"""MTP self-speculative decoding in JAX/Flax."""

from mtp_jax import (
    flax_import,  # noqa: F401  (first: flax without IPython)
    platforms,  # noqa: F401  (before any backend starts: no libtpu without a TPU)
)
from mtp_jax.checkpoint import load, load_model
from mtp_jax.config import DecodeConfig, ModelConfig, MtpConfig, RopeConfig
from mtp_jax.models import (  # noqa: F401  (kernels register: models/dispatch.py)
    cpu_attention,
    cpu_rows,
    fixed_tiles,
    routed_kernel,
)
from mtp_jax.models.causal_lm import CausalLM, hold_for_platform, unstack_layers
from mtp_jax.sampling import SamplingParams
from mtp_jax.speculative import GenerateOutput, generate, generate_chunks
from mtp_jax.text import TextOutput, TextResult, generate_text
from mtp_jax.text_stream import stream_text

__all__ = [
    "CausalLM",
    "DecodeConfig",
    "GenerateOutput",
    "ModelConfig",
    "MtpConfig",
    "RopeConfig",
    "SamplingParams",
    "TextOutput",
    "TextResult",
    "generate",
    "generate_chunks",
    "generate_text",
    "hold_for_platform",
    "load",
    "load_model",
    "stream_text",
    "unstack_layers",
]
