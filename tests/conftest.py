"""Shared fixtures: the real default model (SmolLM2-135M-Instruct GGUF), ours and transformers', loaded once."""

from __future__ import annotations

import os

import pytest

from mtp_jax.errors import UserError


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model's GGUF; CI must have it (its install step fetches it), elsewhere a missing copy skips."""
    from mtp_jax.default_model import default_gguf_path

    try:
        return default_gguf_path()
    except UserError as e:
        if os.environ.get("CI"):
            pytest.fail(f"default model unavailable in CI: {e}")
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """transformers' float32 model of the same GGUF (dequantized by transformers itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_model(smollm2_path):
    """Our model and tokenizer of the default GGUF, float32."""
    from mtp_jax import checkpoint

    return checkpoint.load(smollm2_path, dtype="float32")
