"""MTP self-speculative decoding in JAX/Flax."""

# isort: off
from mtp_jax.runtime import flax_import, platforms  # noqa: F401  (first: flax without IPython, no libtpu without a TPU)

# isort: on
from mtp_jax.config.decode import DecodeConfig
from mtp_jax.config.execution_plan import ExecutionPlan
from mtp_jax.config.model import ModelConfig, MtpConfig, RopeConfig
from mtp_jax.decode.engine import Engine, Request, Update
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import GenerateOutput, generate, generate_chunks
from mtp_jax.decode.text import TextOutput, TextResult, generate_text
from mtp_jax.decode.text_stream import stream_text
from mtp_jax.loading.checkpoint import load, load_model
from mtp_jax.models.causal_lm import CausalLM, hold_for_platform, unstack_layers

__all__ = [
    "CausalLM",
    "DecodeConfig",
    "Engine",
    "ExecutionPlan",
    "GenerateOutput",
    "ModelConfig",
    "MtpConfig",
    "Request",
    "RopeConfig",
    "SamplingParams",
    "TextOutput",
    "TextResult",
    "Update",
    "generate",
    "generate_chunks",
    "generate_text",
    "hold_for_platform",
    "load",
    "load_model",
    "stream_text",
    "unstack_layers",
]
