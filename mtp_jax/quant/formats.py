"""Which weights a format stores quantized, and the whole-model passes: `quantize_model` turns a model's matmul
weights into `--weights int8 | int4 | fp8` (`STORED_FORMATS`: each format's own module says how it is stored,
quantized and multiplied, and which kernels read it), `SHIPPED_BLOCKS` finds a GGUF's Q4_1 / Q8_0 blocks again from
their weights.

A weight is stored quantized where its module declared how products read it (`matmul_axes.MatmulAxes`, beside its
logical axes), along the axes it declared: the trunk's and the MTP layer's projections (its `proj` fusion included)
and routed experts under every format; the embeddings and lm_heads (`vocabulary`; the MTP layer's own too) where
the format names one for them, int8 under int8 and int4 with one scale per vocabulary entry (a small model's tied
head is as large as its layers together and is read at every step: the default model's 28M of its 135M weights;
llama.cpp's files keep it 8-bit too), none under fp8 (the checkpoints keep them in bfloat16). What declares none
stays as it is: norms, biases, routers, the DeltaNet convolution and decay parameters, the shared expert's gate.

    model = formats.quantize_model(model, "fp8")   # in place; greedy MTP stays equal to plain on the stored weights
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from mtp_jax.parallel.sharding import param_axes
from mtp_jax.quant.fp8 import FP8
from mtp_jax.quant.int4 import INT4, quantize_int4
from mtp_jax.quant.int8 import INT8, quantize_int8_blocks
from mtp_jax.quant.int8_activations import in_blocks
from mtp_jax.quant.matmul_axes import MatmulAxes, param_matmul
from mtp_jax.quant.quantized_array import QuantizedArray, WeightFormat

STORED_FORMATS: dict[str, WeightFormat] = {fmt.name: fmt for fmt in (INT8, INT4, FP8)}  # each from its module
# each format's quantizer compiled, one program a weight shape (op by op, a model's weights compiled a dozen small
# programs for each shape)
COMPILED_QUANTIZERS = {name: jax.jit(fmt.quantize, static_argnums=(1, 2)) for name, fmt in STORED_FORMATS.items()}
WEIGHT_FORMATS = ("auto", "bfloat16", *STORED_FORMATS)  # how matmul weights are stored (`--weights`)
ACTIVATION_FORMATS = ("auto", "float", "int8")  # what blocked weights multiply: checkpoint.with_activations


def stored_format(matmul: MatmulAxes | None, weights: str) -> WeightFormat | None:
    """The format that stores a weight declaring `matmul` under `--weights weights`, or None where it stays as it is:
    no declaration, a `weights` that stores none ("auto", "bfloat16"), or an embedding or lm_head under a format that
    names none for them (`WeightFormat.vocabulary`)."""
    stored = STORED_FORMATS.get(weights)
    if matmul is None or stored is None:
        return None
    if matmul.vocabulary:
        return None if stored.vocabulary is None else STORED_FORMATS[stored.vocabulary]
    return stored


def quantize_weight(
    weight: jax.Array, weights: str, contracting: Sequence[int], batched: Sequence[int]
) -> QuantizedArray:
    """`weight` stored as the format `weights` of `STORED_FORMATS` for products over its `contracting` axes, no block
    crossing a `batched` one."""
    return COMPILED_QUANTIZERS[weights](weight, tuple(contracting), tuple(batched))


def stored_weight(weight: jax.Array, weights: str, matmul: MatmulAxes | None) -> QuantizedArray | None:
    """`weight`, declaring `matmul` (over its whole array: `matmul_axes.param_matmul`), as `--weights weights` stores
    it (`stored_format`), or None where it stays as it is."""
    stored = stored_format(matmul, weights)
    return None if stored is None else quantize_weight(weight, stored.name, matmul.contracting, matmul.batched)


def quantize_model(model, weights: str):
    """Quantize every matmul weight of `model` in place to `weights` (a format of `STORED_FORMATS`: `stored_weight`;
    "auto": as it is; "bfloat16": weights stored quantized dequantized into the model's dtype) and return it; on a
    mesh, the values keep the weight's sharding and the scales lie as the weight's axes do where the mesh divides them
    (else replicated)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "bfloat16":  # a model stored quantized (a converted folder's kept fp8) read back in its dtype
        for _, param in nnx.iter_graph(model):
            if isinstance(param, nnx.Param) and isinstance(param.get_value(), QuantizedArray):
                param.set_value(param.get_value().dequantize())
    if weights not in STORED_FORMATS:
        return model
    rules = getattr(model, "sharding_rules", None)
    for path, param in list(nnx.iter_graph(model)):
        if not isinstance(param, nnx.Param) or isinstance(param.get_value(), QuantizedArray):
            continue
        name = "/".join(str(p) for p in path)
        quantized = stored_weight(param.get_value(), weights, param_matmul(param, name))
        if quantized is None:
            continue
        if rules is not None:  # values and scales laid out as the weight
            layout = param_axes(param, name)
            place = lambda leaf, layout=layout: jax.device_put(leaf, rules.sharding(layout, leaf.shape))
            quantized = jax.tree.map(place, quantized)
        param.set_value(quantized)
    return model


def head_in_trunk_blocks(model):
    """Under `--weights auto`, where the trunk's projections are held in a GGUF's blocks (a CPU's row kernel reads
    them as stored: Q4_1 / Q8_0), store the MTP layer's projections (its fusion `proj` included) in Q8_0 blocks too
    (`quantize_int8_blocks`: int8, a float16 scale per 32 contracting elements), in place: a draft pass then reads a
    quarter of a float32 layer's bytes, through the same kernel. Returns the model."""
    trunk_blocks = any(
        isinstance(param.get_value(), QuantizedArray) and in_blocks(param.get_value())
        for path, param in nnx.iter_graph(model)
        if isinstance(param, nnx.Param) and "mtp" not in path
    )
    if not trunk_blocks or getattr(model, "sharding_rules", None) is not None:
        return model
    for path, param in list(nnx.iter_graph(model)):
        if not isinstance(param, nnx.Param) or "mtp" not in path or isinstance(param.get_value(), QuantizedArray):
            continue
        matmul = param_matmul(param, "/".join(str(p) for p in path))
        if matmul is not None and not matmul.vocabulary:
            param.set_value(SHIPPED_BLOCKS["Q8_0"](param.get_value(), matmul.contracting))
    return model


# How a GGUF's block formats are held when weights are kept as the checkpoint ships them ("auto"), where their
# blocks cannot be moved as stored (conversion/gguf_blocks.py): by the quantizer that finds the file's own blocks
# again from the weights they dequantize to (gguf_source.block_format names them). Jitted: one program a shape.
SHIPPED_BLOCKS = {
    "Q4_1": jax.jit(quantize_int4, static_argnums=1),
    "Q8_0": jax.jit(quantize_int8_blocks, static_argnums=1),
}
