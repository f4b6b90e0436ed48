"""hlo_text.dot_flops, the plans' flop count where an executable has no cost analysis (cross-compiled for
compile-only GPUs), against multiply-adds counted by hand: products in a loop counted per iteration, batched and
multi-axis contractions, and XLA:GPU's cuBLAS gemm calls whose contracting axes sit in their backend config."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.plan.hlo_text import dot_flops


def test_products_in_a_loop_count_once_per_iteration():
    layers, d, f = 3, 64, 96

    def decode(stack, x):  # stack [L, D, F], x [4, D]
        def layer(x, w):
            return jnp.tanh(x @ w)[:, :d], None

        return jax.lax.fori_loop(0, 5, lambda _, x: jax.lax.scan(layer, x, stack)[0], x)

    compiled = jax.jit(decode).lower(jnp.ones((layers, d, f)), jnp.ones((4, d))).compile()
    assert dot_flops(compiled.as_text()) == 2 * 5 * layers * 4 * d * f


def test_batched_and_multi_axis_contractions():
    x, w = jnp.ones((2, 3, 8, 5)), jnp.ones((2, 8, 5, 7))  # batch 2, contracting 8 x 5
    compiled = jax.jit(lambda x, w: jnp.einsum("bsij,bijk->bsk", x, w)).lower(x, w).compile()
    assert dot_flops(compiled.as_text()) == 2 * (2 * 3 * 7) * (8 * 5)


GPU_GEMM = """HloModule jit_f, entry_computation_layout={(bf16[16,7168]{1,0}, bf16[7168,2048]{1,0})->bf16[16,2048]{1,0}}

ENTRY %main.3 (x: bf16[16,7168], w: bf16[7168,2048]) -> bf16[16,2048] {
  %x = bf16[16,7168]{1,0} parameter(0)
  %w = bf16[7168,2048]{1,0} parameter(1)
  %custom-call.1 = (bf16[16,2048]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", \
backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,\
"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],\
"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"alpha_imag":0,"epilogue":"DEFAULT"}}
  ROOT %get-tuple-element.1 = bf16[16,2048]{1,0} get-tuple-element(%custom-call.1), index=0
}
""".replace("\\\n", "")


def test_gpu_gemm_library_calls_count_from_their_config():
    assert dot_flops(GPU_GEMM) == 2 * 16 * 2048 * 7168
