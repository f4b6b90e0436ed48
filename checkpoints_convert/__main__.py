"""python -m checkpoints_convert SRC DST [--dtype bfloat16|float32] [--weights FORMAT] [--overwrite]"""

from __future__ import annotations

import argparse
import time

from mtp_jax.conversion.convert import config_of, convert_params, write_converted
from mtp_jax.conversion.writer import check_destination
from mtp_jax.params.open_source import open_source
from mtp_jax.quant.formats import WEIGHT_FORMATS
from mtp_jax.runtime.errors import exit_process, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face safetensors folder or a .gguf file into an mtp_jax folder.",
    )
    parser.add_argument("src", help="Hugging Face model folder or .gguf file")
    parser.add_argument("dst", help="new output folder (written atomically)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto", help="how matmul weights are stored: "
                        "auto as the checkpoint ships them (fp8 with block scales stays fp8), bfloat16 in --dtype, "
                        "int8 with per-channel scales, fp8 with 128 x 128 block scales (mtp_jax/quant/)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    return parser


def convert(args: argparse.Namespace) -> int:
    """Convert SRC into DST (written whole or not at all), then one summary line."""
    start = time.perf_counter()
    try:
        check_destination(args.dst, args.overwrite)
        source = open_source(args.src)
        cfg = config_of(source)
        mtp = f"MTP head ({cfg.mtp.layout} layout)" if cfg.has_mtp else "no MTP head"
        print(f"family {cfg.family}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {mtp}")
        params, plan = convert_params(source, cfg, args.dtype, weights=args.weights)
        report = {
            "source": args.src,
            "dtype": args.dtype,
            "weights": args.weights,
            "tensors_used": len(plan.targets),
            "tensors_ignored": plan.ignored,
        }
        write_converted(args.dst, cfg, params, source.load_tokenizer(), report, args.overwrite)
    except OSError as e:  # a file the error does not name is SRC's
        raise OSError(e.errno, e.strerror or str(e), e.filename or args.src) from None
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"nothing half-written at {args.dst}") from None
    total = len(plan.targets) + len(plan.ignored)
    ignored = f", {len(plan.ignored)} ignored" + (
        f" ({'; '.join(sorted(set(plan.ignored.values())))})" if plan.ignored else ""
    )
    print(
        f"tensors: {total} in checkpoint, {len(plan.targets)} used{ignored}; "
        f"every parameter filled; wrote {args.dst} in {time.perf_counter() - start:.1f}s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(convert, build_parser().parse_args(argv))


if __name__ == "__main__":
    exit_process(main())
