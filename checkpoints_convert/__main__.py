"""python -m checkpoints_convert SRC DST [--dtype bfloat16|float32] [--overwrite]"""

from __future__ import annotations

import argparse
import sys
import time

from checkpoints_convert.errors import ConversionError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face safetensors folder or a .gguf file into an mtp_jax folder.",
    )
    parser.add_argument("src", help="Hugging Face model folder or .gguf file")
    parser.add_argument("dst", help="new output folder (written atomically)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        from checkpoints_convert.convert import config_of, convert_params, write_converted
        from checkpoints_convert.source import open_source
        from checkpoints_convert.writer import check_destination

        check_destination(args.dst, args.overwrite)
        source = open_source(args.src)
        cfg = config_of(source)
        mtp = f"MTP head ({cfg.mtp.layout} layout)" if cfg.has_mtp else "no MTP head"
        print(f"family {cfg.family}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {mtp}")
        params, plan = convert_params(source, cfg, args.dtype)
        report = {
            "source": args.src,
            "dtype": args.dtype,
            "tensors_used": len(plan.targets),
            "tensors_ignored": plan.ignored,
        }
        write_converted(args.dst, cfg, params, source.load_tokenizer(), report, args.overwrite)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or args.src}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: nothing half-written at {args.dst}", file=sys.stderr)
        return 130
    total = len(plan.targets) + len(plan.ignored)
    ignored = f", {len(plan.ignored)} ignored" + (
        f" ({'; '.join(sorted(set(plan.ignored.values())))})" if plan.ignored else ""
    )
    print(
        f"tensors: {total} in checkpoint, {len(plan.targets)} used{ignored}; "
        f"every parameter filled; wrote {args.dst} in {time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
