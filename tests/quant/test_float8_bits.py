"""float8 weights held as their bits on a CPU (`quant.hold_float8_as_bits`, what decode, bench and plan do there):
the same values and the same tokens as the float8 arrays, and the generate program no longer holds a float16 copy
of them (XLA:CPU converts a float8 parameter whole before the decode loop; bits are read back a layer at a time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.parallel import sharding
from mtp_jax.params.stored_weights import split_quantized
from mtp_jax.plan import planning, topology
from mtp_jax.quant import formats, fp8, quantized_array
from tests.support.commands import run_plan
from tests.support.decode_models import MODELS, decode, prompts_for

pytestmark = pytest.mark.slow


def float8_weights(model) -> dict[str, quantized_array.QuantizedArray]:
    return {
        "/".join(map(str, path)): param.get_value()
        for path, param in nnx.iter_graph(model)
        if isinstance(param, nnx.Param) and isinstance(param.get_value(), quantized_array.QuantizedArray)
    }


def test_bits_hold_the_same_values_and_decode_the_same_tokens():
    model = formats.quantize_model(MODELS["mla_moe"](), "fp8")
    held = mtp_jax.hold_for_platform(formats.quantize_model(MODELS["mla_moe"](), "fp8"), "stacked")  # on this CPU
    stored, bits = float8_weights(model), float8_weights(held)
    assert stored.keys() == bits.keys() and len(bits) >= 6
    for path, weight in bits.items():
        assert weight.values.dtype == jnp.uint8 and weight.bits_of == jnp.float8_e4m3fn, path
        expected = np.asarray(stored[path].values).view(np.uint8)  # the float8 values' own bytes
        np.testing.assert_array_equal(np.asarray(weight.values), expected)
        np.testing.assert_array_equal(np.asarray(weight.as_stored().values), np.asarray(stored[path].values))
    written, manifest = split_quantized({tuple(path.split("/")): weight for path, weight in bits.items()})
    assert {entry["values_dtype"] for entry in manifest.values()} == {"float8_e4m3fn"}  # files keep float8
    assert {part["values"].dtype for part in written.values()} == {jnp.dtype(jnp.float8_e4m3fn)}

    prompts = prompts_for(model)  # a round of drafts runs the trunk, its verify and the MTP layer
    np.testing.assert_array_equal(decode(held, prompts, 2).tokens, decode(model, prompts, 2).tokens)


def test_generate_program_drops_the_float16_copy_of_float8_weights():
    """The compiled generate's temporaries (`memory_analysis`), float8 arrays against their bits, for a trunk of 8
    stacked layers: held as float8, XLA:CPU keeps a float16 copy of every trunk value (2 bytes each); as bits, only
    a layer's slice is converted at a time, so at least the copy of the other 7 layers is gone (measured: all of
    it)."""
    layers = 8
    cfg = MODELS["gqa"]().config.replace(num_layers=layers)
    rules = sharding.ShardingRules(sharding.make_mesh("data=1,model=1", jax.devices("cpu")[:1]))
    work = planning.Workload(batch=1, prompt_len=8, max_new_tokens=16, num_draft=2)
    target = topology.resolve("cpu:1")

    def abstract(hold: bool):
        build = lambda: formats.quantize_model(CausalLM(cfg, dtype=jnp.bfloat16), "fp8")
        model = nnx.eval_shape(lambda: fp8.hold_float8_as_bits(build()) if hold else build())
        model = sharding.map_params(model, lambda leaf, axes: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=rules.sharding(axes, leaf.shape)))  # fmt: skip
        model.sharding_rules = rules
        return model

    temporaries = {}
    for hold in (False, True):
        model = abstract(hold)
        report = planning.memory_report(model, work, target, planning.start_state(model, work, 2))
        temporaries[hold] = report["temporaries"]
    trunk = sum(w.values.size for path, w in float8_weights(abstract(True)).items() if path.startswith("segments"))
    saved = temporaries[False] - temporaries[True]
    print(f"temporaries: float8 {temporaries[False]}, bits {temporaries[True]}; trunk float8 values {trunk}")
    assert saved >= 2 * trunk * (layers - 1) / layers


@pytest.mark.multidevice
def test_plan_of_float8_experts_split_over_host_devices():
    """`plan` on `cpu:2` holds float8 weights as bits, the routed experts split over 2 devices inside shard_map
    (whose specs carry the weights' bits type): it compiles, and the tiny model fits."""
    plan_args = ("--random-shape", "deepseek-v3-tiny", "--topology", "cpu:2", "--mesh", "data=1,model=1,expert=2",
                "--weights", "fp8", "--max-new-tokens", "16", "--prompt-len", "8", "--num-draft", "0")  # fmt: skip
    proc = run_plan(*plan_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GiB: fits" in proc.stderr
