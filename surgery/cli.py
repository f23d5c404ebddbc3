"""The `surgery` command (also `python -m surgery`)."""

from __future__ import annotations

import argparse
import json
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

    plan = commands.add_parser(
        "plan",
        help="the per-rank layout, memory and collectives of a FLUX.2 config at a TP size, on one CPU",
        description="Builds the model on the meta device, unfuses it and shards it under torch's fake process group "
        "(nothing is allocated, no accelerator needed), then prints each parameter's placement and per-rank shape, "
        "the bytes per rank, and the collectives of one forward.",
    )
    _model_arguments(plan, CONFIGS)
    plan.add_argument("--tp", type=_positive, required=True, help="tensor-parallel size")
    plan.add_argument("--cp", type=_positive, default=1, help="context-parallel (Ulysses) size (default 1)")
    plan.add_argument("--dp", type=_positive, default=1, help="FSDP2 data-parallel size (default 1)")
    plan.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    plan.add_argument("--image-tokens", type=_positive, default=4096, help="default 4096 (a 1024x1024 image)")
    plan.add_argument("--text-tokens", type=_positive, default=512)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    inspect = commands.add_parser(
        "inspect",
        help="the rewrite table of a FLUX.2 config: which fused rows/columns each unfused Linear takes",
        description="Builds the model on the meta device and lists what surgery.unfuse rewrites: module, class before "
        "-> after, and the rows (views) or columns (copies) of the fused weight each new parameter takes.",
    )
    _model_arguments(inspect, CONFIGS)
    inspect.add_argument("--all", action="store_true", help="one row per block instead of one per block kind")

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


def _model_arguments(parser: argparse.ArgumentParser, configs: dict) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", choices=sorted(configs), default="klein-9b")
    group.add_argument("--config", help="a diffusers transformer config.json instead")


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, dict]:
    from rewrites.flux2 import CONFIGS

    if args.config is None:
        return f"FLUX.2-{args.model}", dict(CONFIGS[args.model])
    try:
        with open(args.config) as f:
            config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    except (OSError, ValueError) as error:
        parser.error(f"--config {args.config}: {error}")
    return args.config, config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("plan", "inspect"):
        return _plan_or_inspect(parser, args)
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


def _plan_or_inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch
    from diffusers import Flux2Transformer2DModel

    from . import inspect, render
    from .checks import SurgeryError

    name, config = _config(parser, args)
    if args.command == "inspect":
        with torch.device("meta"):
            model = Flux2Transformer2DModel(**config)
        rows = inspect.rewrite_table(model)
        if not args.all:
            rows = inspect.collapse_blocks(rows, "module", also=("parameter",))
        print(f"{name}: what surgery.unfuse rewrites (rows are views of the fused weight, columns are copies)\n")
        print(render.text_table(rows))
        return 0
    try:
        result = inspect.plan(config, args.tp, dtype=getattr(torch, args.dtype), image_tokens=args.image_tokens,
                              text_tokens=args.text_tokens, cp=args.cp, dp=args.dp)
    except SurgeryError as error:
        parser.exit(1, f"surgery plan: {error}\n")
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(render.plan_text(name, result))
        if args.cp > 1 or args.dp > 1:
            print(_mesh_lines(result))
    return 0


def _mesh_lines(result: dict) -> str:
    """What `plan --cp/--dp` adds to the report: the mesh, tokens per rank, and bytes by collective kind."""
    c = result["collectives"]
    lines = [f"mesh (dp, cp, tp) = ({result['dp']}, {result['cp']}, {result['tp']}): "
             f"{result['tokens']['per_rank']} tokens per rank (Ulysses over cp, FSDP2 over dp)"]
    lines += [f"  {op}: {c['ops'][op]} per forward, {c['bytes_by_op'][op] / 2**20:,.1f} MiB of input tensors per rank"
              for op in sorted(c["ops"])]
    if "fsdp_all_gathers" in c:
        lines.append(f"  (FSDP2's {c['fsdp_all_gathers']['count']} all-gathers are counted on paper: one per block "
                     "and one for the root; its forward refuses meta parameters)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
