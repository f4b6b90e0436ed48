"""Arguments the commands share: counts, the weights' storage, a multi-process run, output paths."""

from __future__ import annotations

import argparse
import os

import jax

from mtp_jax.config.model import LAYER_LAYOUTS
from mtp_jax.quant.formats import ACTIVATION_FORMATS, WEIGHT_FORMATS
from mtp_jax.runtime.errors import UserError
from mtp_jax.runtime.files import nearest_existing_ancestor


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """--weights and --layer-layout: how the loaded model holds its weights (decode and bench)."""
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                        help="auto: as the checkpoint ships them (fp8 block-scaled weights stay fp8); bfloat16: "
                        "dequantized; int8 (per-channel scales) or fp8 (128x128 block scales): matmul weights stored "
                        "so, dequantized inside the step (about half the bytes of bfloat16 per step)")  # fmt: skip
    parser.add_argument("--layer-layout", choices=LAYER_LAYOUTS, default="auto",
                        help="layer parameters stacked (scanned) or unstacked (one array per layer; longer compiles); "
                        "auto: unstacked where a scan copies each layer's weights every step (GPU), else "
                        "stacked")  # fmt: skip
    parser.add_argument("--activations", choices=ACTIVATION_FORMATS, default="auto",
                        help="int8: round the activations to int8 per block before each product with a weight in "
                        "blocks (--weights int4, or a GGUF's Q4_1 and Q8_0 blocks), as llama.cpp does: another model "
                        "of the same weights, faster on a CPU whose row kernel has integer dot products (AVX512-VNNI, "
                        "AVX2, NEON dotprod); float: as they are; auto (default): int8 where a GGUF's blocks are "
                        "kept on such a CPU, else float")  # fmt: skip


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several processes (hosts): run the same command in each")
    auto = "jax.distributed.initialize() from the environment (TPU pod slice, SLURM, Open MPI)"
    group.add_argument("--distributed", action="store_true", help=auto)
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (with the next two options)")
    group.add_argument("--num-processes", type=positive_int)
    group.add_argument("--process-id", type=non_negative_int)


def start_distributed(args) -> None:
    """Join the multi-process runtime when asked (before JAX touches a device)."""
    manual = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in manual) and any(v is None for v in manual):
        raise UserError("--coordinator, --num-processes and --process-id go together")
    if not args.distributed and manual[0] is None:
        return

    try:
        jax.distributed.initialize(*manual)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"jax.distributed.initialize failed: {e}") from None


def float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def check_output_path(path: str, option: str) -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, or one under a file."""
    if os.path.isdir(path):
        raise UserError(f"{option} {path}: is a folder")
    ancestor = nearest_existing_ancestor(path)
    if not os.path.isdir(ancestor):
        raise UserError(f"{option} {path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: cannot write in {ancestor}")


TREE_DEPTH = 3  # a draft tree's depth (--num-draft) where --tree leaves it open


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """--tree N and --tree-width W: drafting a tree of N nodes instead of a chain (DecodeConfig.tree)."""
    depth = f"--num-draft deep (default {TREE_DEPTH})"
    tree_help = f"draft a tree of N nodes a round, {depth}, verified in one pass (0: chains)"
    parser.add_argument("--tree", type=non_negative_int, default=0, metavar="N", help=tree_help)
    width_help = "with --tree: nodes expanded at each depth, and children each proposes"
    parser.add_argument("--tree-width", type=positive_int, default=4, metavar="W", help=width_help)
