"""bench.call_profile: a round's traced calls named from its compiled program, by kind."""

from __future__ import annotations

import numpy as np
import pytest

from mtp_jax.bench.call_profile import by_kind, instructions, round_calls
from mtp_jax.kernels.cpu import cpu_rows
from tests.support.decode_models import MODELS


def test_instructions_are_named_with_their_target_and_source():
    text = "\n".join([
        '  %fusion.3 = f32[1,2]{1,0} fusion(f32[1,2]{1,0} %p), metadata={op_name="jit(f)/trunk/mul"}',
        '  ROOT %custom-call.7 = f32[1,8]{1,0} custom-call(f32[1,4]{1,0} %x), custom_call_target="mtp_jax_row_matmul", '
        'metadata={op_name="jit(f)/mtp/ffi_call"}',
    ])  # fmt: skip
    assert instructions(text) == {
        "fusion.3": ("fusion", "jit(f)/trunk/mul"),
        "custom-call.7": ("mtp_jax_row_matmul", "jit(f)/mtp/ffi_call"),
    }


@pytest.mark.skipif(cpu_rows.status() != "ready", reason="the CPU row kernel is not built here")
def test_a_drafting_round_shows_the_mtp_layers_calls_and_a_plain_one_does_not():
    model = MODELS["gqa"]()
    prompt = np.arange(1, 9, dtype=np.int32)[None] % model.config.vocab_size  # [1, 8]
    plain, drafting = (by_kind(round_calls(model, prompt, k, rounds=4, max_new_tokens=16)) for k in (0, 2))
    assert plain["xla"] > 0 and drafting["xla"] > 0
    assert any(kind.startswith("mtp_jax") for kind in plain)  # the kernel's products and attention
    assert not any(kind.endswith(":mtp") for kind in plain)
    assert any(kind.endswith(":mtp") for kind in drafting)
    assert sum(drafting.values()) > 0
