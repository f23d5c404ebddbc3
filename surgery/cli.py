"""The `surgery` command (also `python -m surgery`)."""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from rewrites.flux2 import CONFIGS

    parser = argparse.ArgumentParser(prog="surgery", description="Unfuse FLUX.2 and shard it with stock torch TP.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="unfuse a seeded FLUX.2-klein-shaped model and shard it over CPU processes (no downloads)",
        description="Builds a FLUX.2-shaped model at reduced depth and head size with seeded weights, unfuses it, "
        "checks it against the fused model, then runs tensor parallelism on N CPU processes (gloo) and prints "
        "errors, collectives, per-rank memory and timings.",
    )
    demo.add_argument("--model", choices=sorted(CONFIGS), default="klein-4b", help="config to take the shape of")
    demo.add_argument("--tp", type=_positive, default=2, help="CPU processes to shard over (default 2)")
    demo.add_argument("--layers", type=_positive, default=2, help="double-stream blocks (default 2)")
    demo.add_argument("--single-layers", type=_positive, default=4, help="single-stream blocks (default 4)")
    demo.add_argument("--head-dim", type=_positive, default=32, help="head size, a multiple of 8 (default 32)")
    demo.add_argument("--image-tokens", type=_positive, default=64)
    demo.add_argument("--text-tokens", type=_positive, default=32)
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    demo.add_argument("--seed", type=int, default=0)

    convert = commands.add_parser(
        "convert",
        help="rewrite a diffusers checkpoint into the unfused layout, or back (streaming, tensor by tensor)",
        description="Reads SRC (a diffusers model folder, a pipeline folder or a cached repo id) and writes DST with "
        "the same config.json and one safetensors file in the other layout. Memory: about one tensor.",
    )
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--to", choices=["unfused", "fused"], default="unfused")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from rewrites.flux2 import CONFIGS

        heads = CONFIGS[args.model]["num_attention_heads"]
        if heads % args.tp:
            parser.error(f"--tp {args.tp} does not divide the {heads} heads of {args.model}")
        if args.head_dim % 8:
            parser.error(f"--head-dim {args.head_dim} is not a multiple of 8 (4 rotary axes of even size)")
        from .demo import run

        return run(args.model, args.tp, args.layers, args.single_layers, args.head_dim, args.seed, args.dtype,
                   args.image_tokens, args.text_tokens)
    if args.command == "convert":
        from .checks import SurgeryError
        from .checkpoint import convert_checkpoint

        try:
            print(f"wrote {convert_checkpoint(args.src, args.dst, to=args.to)}")
        except SurgeryError as error:
            parser.exit(1, f"surgery convert: {error}\n")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
