"""`load_model`: a converted folder, a Hugging Face folder or repo id, a .gguf (or the default model) -> `CausalLM`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mtp_jax.conversion.convert import config_of
from mtp_jax.conversion.placement import read_params
from mtp_jax.kernels.cpu import cpu_rows
from mtp_jax.loading.default_conversion import load_default
from mtp_jax.loading.heads import attach_head, head_for
from mtp_jax.loading.hub import local_path
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.parallel.sharding import ShardingRules, rules_for
from mtp_jax.params.converted import is_converted, restore_converted
from mtp_jax.params.open_source import open_source
from mtp_jax.params.tree import assemble, nest
from mtp_jax.quant.formats import ACTIVATION_FORMATS, head_in_trunk_blocks, quantize_model
from mtp_jax.quant.int8_activations import has_int8_activations, mark_int8_activations
from mtp_jax.quant.quantized_array import is_quantized
from mtp_jax.quant.row_tiles import draft_table_in_tiles, tile_for_row_kernel
from mtp_jax.runtime.errors import UserError
from mtp_jax.runtime.transformers_import import import_transformers


def default_dtype():
    """float32 on CPU (XLA's CPU bf16 matmuls are slow), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load(
    path: str | None = None,
    *,
    dtype=None,
    mesh: Mesh | ShardingRules | None = None,
    head: str | None = None,
    default_head: bool = True,
    weights: str = "auto",
    activations: str = "auto",
    float_head: bool = False,
):
    """(model, tokenizer or None) for `path`; None means the default model. `path` may also be a Hugging Face repo
    id, `ORG/NAME[@REVISION]` (`mtp_jax.loading.hub`; an existing local path of that name wins).

    `mesh`: a `jax.sharding.Mesh` (default rules of `parallel/sharding.py`) or `ShardingRules`; every parameter is then
    placed directly into its sharding, and each process reads only the parts of the tensors its devices hold.

    `head`: a head folder written by `python -m mtp_jax.train_head`; without one, the shipped head of the default
    model, or an `mtp_head/` folder inside the model folder, is attached when present (`default_head=False`: not;
    e.g. to train a new head on the bare trunk).

    `weights` (mtp_jax/quant/): "auto" keeps the weights as the checkpoint ships them (fp8 with block scales stays
    fp8, dequantized inside the jitted step; on a CPU with one device a GGUF's Q4_1 and Q8_0 blocks stay in them,
    as int4 and int8 with float16 block scales, `keeps_gguf_blocks`; the rest in `dtype`); "bfloat16" dequantizes
    everything into `dtype`; "int8" stores every matmul weight (trunk and MTP layer) as int8 with per-channel
    scales; "int4" as 4-bit blocks (`quant.quantize_int4`); "fp8" keeps an fp8 checkpoint as shipped and stores
    every matmul weight of any other as fp8 with 128 x 128 block scales.

    `activations`: "float" multiplies every weight by the activations as they are; "int8" rounds them to int8 per
    block before each product with a weight in blocks, as llama.cpp does (`quant.mark_int8_activations`): another
    model of the same weights, faster on a CPU whose row kernel sums integer products in vectors. Needs weights in
    blocks ("int4", or a GGUF's Q4_1 / Q8_0 under "auto"). "auto" (the default): "int8" where `int8_pays`, else
    "float".

    `float_head`: the MTP head stays in `dtype` beside a trunk in blocks (a head to train), instead of the Q8_0
    blocks a decode reads it in (`head_in_trunk_blocks`).
    """
    if activations not in ACTIVATION_FORMATS:
        raise UserError(f"activations must be one of {', '.join(ACTIVATION_FORMATS)}; got {activations!r}")
    path = None if path is None else local_path(path)
    model, tokenizer = _load_trunk(path, dtype=dtype, mesh=mesh, weights=weights)
    head = head or (head_for(path) if default_head else None)
    model = attach_head(model, head) if head else model
    if not (weights == "fp8" and is_quantized(model)):  # the checkpoint's own fp8: what it left alone stays so
        model = quantize_model(model, weights)
    rules = rules_for(mesh)
    if keeps_gguf_blocks(weights, rules) and not float_head:
        model = head_in_trunk_blocks(model)  # a GGUF trunk's blocks: the MTP layer in Q8_0 blocks beside them
    return in_row_kernel_order(with_activations(model, activations, rules, weights), rules), tokenizer


def int8_pays(weights: str, rules: ShardingRules | None) -> bool:
    """Whether activations rounded to int8 are the faster model here for weights loaded as `weights`: a GGUF's blocks
    kept on a CPU (`keeps_gguf_blocks`) and a row kernel whose int8-rows product sums integer products in vectors
    (vpdpbusd with AVX512-VNNI, vpmaddubsw with AVX2, sdot with NEON's dotprod). Measured:
    docs/benchmarks.md#avx512-host-intel-xeon."""
    return keeps_gguf_blocks(weights, rules) and cpu_rows.integer_dot() not in (None, "none")


def with_activations(model, activations: str, rules: ShardingRules | None = None, weights: str = "auto"):
    """`model` with its weights in blocks multiplying activations as `activations` says (`load`); "auto" rounds them
    where `int8_pays` and the model holds weights in blocks (a GGUF's), and leaves any other model as it is."""
    if activations == "auto":
        if int8_pays(weights, rules):
            mark_int8_activations(model)
        return model
    if activations == "int8" and not mark_int8_activations(model):
        raise UserError(
            "activations int8 needs weights in blocks: --weights int4, or a GGUF's Q4_1 and Q8_0 blocks under "
            "--weights auto on a CPU"
        )
    return model


def in_row_kernel_order(model, rules: ShardingRules | None = None):
    """`model` with the weights that the CPU row kernel's int8-rows product reads stored in its tile order
    (`quant.row_tiles`: one sequential stream a weight, the same results; a tied embedding, read as the lm_head, then
    by int8 rows too, and the draft vocabulary's rows of it held in tiles of their own: `draft_table_in_tiles`), in
    place, where that kernel runs: a CPU, one device, the kernel built."""
    one_device = rules is None or rules.mesh.devices.size == 1
    if jax.default_backend() == "cpu" and one_device and has_int8_activations(model) and cpu_rows.status() == "ready":
        tile_for_row_kernel(model)
        table = draft_table_in_tiles(model.draft_head()) if model.embed.get_value().tile_axes is not None else None
        if table is not None:
            model.hold_draft_table(table)
    return model


def keeps_gguf_blocks(weights: str, rules: ShardingRules | None) -> bool:
    """Whether `weights` keeps a GGUF's Q4_1 / Q8_0 blocks here: under "auto" where the CPU row kernel reads them as
    stored (a CPU, one device). Elsewhere XLA would unpack them into full-size arrays before each dot (on TPU, many
    times the stored bytes moved; measured:
    docs/benchmarks-log.md#4-bit-weights-and-the-ggufs-own-blocks-085x-llamacpp-at-batch-1-cpu), so they are
    dequantized on load."""
    one_device = rules is None or rules.mesh.devices.size == 1
    return weights == "auto" and jax.default_backend() == "cpu" and one_device


def _load_trunk(path, *, dtype, mesh, weights: str = "auto"):
    rules = rules_for(mesh)
    dtype = jnp.dtype(dtype or default_dtype())
    keep_blocks = keeps_gguf_blocks(weights, rules)
    if path is None:
        return load_default(dtype, rules, keep_blocks=keep_blocks)
    if os.path.isdir(path) and is_converted(path):
        tokenizer = None
        if any(f.startswith("tokenizer") for f in os.listdir(path)):
            tokenizer = import_transformers().AutoTokenizer.from_pretrained(path)
        return restore_converted(path, dtype, rules), tokenizer
    source = open_source(path)
    cfg = config_of(source)
    params = read_params(source, cfg, dtype, rules, keep_fp8=weights in ("auto", "fp8"), keep_blocks=keep_blocks)
    return assemble(cfg, nest(params), dtype, rules), source.load_tokenizer()


def load_model(
    path: str | None = None,
    *,
    dtype=None,
    mesh: Mesh | ShardingRules | None = None,
    head: str | None = None,
    default_head: bool = True,
    weights: str = "auto",
    activations: str = "auto",
) -> CausalLM:
    """The model at `path` (converted folder, Hugging Face folder or repo id `ORG/NAME[@REVISION]`, or .gguf); None
    means the default model.
    `mesh`, `head`, `default_head`, `weights`, `activations`: as `load` takes them."""
    return load(
        path, dtype=dtype, mesh=mesh, head=head, default_head=default_head, weights=weights, activations=activations
    )[0]
