"""Under `--weights int8` / `fp8` a plan's MTP layer is stored as its trunk is, so its draft passes read int8 or fp8
bytes, not a bfloat16 copy: MiMo-7B's released shape, laid out abstractly (no memory, no compile)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from mtp_jax.parallel.sharding import ShardingRules, make_mesh
from mtp_jax.plan.planning import abstract_model
from mtp_jax.plan.shapes import full_shape
from mtp_jax.quant.quantized_array import QuantizedArray

STORED = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_a_plans_mtp_layer_is_stored_in_the_trunks_format(weights):
    cfg = full_shape("mimo-7b")
    rules = ShardingRules(make_mesh("data=1", jax.devices()[:1]))
    model = abstract_model(cfg, jnp.bfloat16, rules, weights)
    flat = {"/".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    is_matmul = lambda path: path.split("/")[-1].endswith("proj")  # attention and MLP projections, the fusion
    mtp = {path: value for path, value in flat.items() if path.startswith("mtp/") and is_matmul(path)}
    trunk = {path: value for path, value in flat.items() if path.startswith("segments/") and is_matmul(path)}
    assert "mtp/proj" in mtp and any("q_proj" in path for path in mtp), sorted(mtp)
    for path, value in {**mtp, **trunk}.items():
        assert isinstance(value, QuantizedArray), path
        stored = value.bits_of or value.values.dtype  # a CPU mesh holds float8 values as their bits
        assert np.dtype(stored) == STORED[weights] and value.values.dtype.itemsize == 1, (path, stored)
    mtp_bytes = sum(value.values.size * value.values.dtype.itemsize for value in mtp.values())
    bf16_bytes = sum(value.values.size * 2 for value in mtp.values())
    assert mtp_bytes * 2 == bf16_bytes  # one byte a weight, half a bfloat16 layer's
