"""The `surgery` command (also `python -m surgery`)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import torch

from surgery.app import coverage
from surgery.app.demo import demo_config, run
from surgery.core.build import check_config, model_on_meta
from surgery.core.errors import SurgeryError
from surgery.core.registry import families, model_names, resolve_model
from surgery.core.rewrite import unfuse
from surgery.io.checkpoint import convert_checkpoint
from surgery.parallel.pipeline import pipeline_plan, pipeline_plan_text
from surgery.parallel.plans import block_path, checked_plan, effective_plan, plan_source, style_source, wildcard_path
from surgery.sight import diagram, forms, render, report, svg
from surgery.sight import explore as explorer  # its functions looked up on call: tests stand in for the server
from surgery_cli import listing


def _between(low: int, high: int, what: str):
    """An argparse type: a whole number from `low` to `high`; the bound keeps a hostile number (a 23-digit --tp) from
    reaching torch, which would allocate for it or fail deep inside."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high} ({what}), got {value}")
        return value

    return parse


_ranks = _between(1, 2**16, "ranks of a mesh")
_tokens = _between(1, 2**24, "tokens per sample")
_size = _between(1, 2**16, "a model dimension")


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, got {value}")
    return value


class _Formatter(argparse.HelpFormatter):
    """argparse's help, wrapped at spaces only (model names such as `hunyuan-image-2.1` are never broken at a
    hyphen); lines of an epilog that start with two spaces are kept as they are (the list of models)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text, width, indent):
        out = []
        for paragraph in text.split("\n"):
            if paragraph.startswith("  "):
                head, _, rest = paragraph.strip().partition(": ")
                out.append(textwrap.fill(rest, width, initial_indent=f"{indent}  {head}: ",
                                         subsequent_indent=f"{indent}      ", break_on_hyphens=False,
                                         break_long_words=False))
            else:
                out.append(textwrap.fill(" ".join(paragraph.split()), width, initial_indent=indent,
                                         subsequent_indent=indent, break_on_hyphens=False, break_long_words=False))
        return "\n".join(out)


def _models_epilog() -> str:
    return "models (--model), by family:\n" + "\n".join(
        f"  {family}: {', '.join(names)}" for family, names in model_names(by_family=True).items())


def _model(text: str) -> str:
    """`--model`'s type: a registered name (or unambiguous alias); an unknown or ambiguous one is a usage error that
    lists the candidates."""

    try:
        resolve_model(text)
    except SurgeryError as error:
        message = str(error)
        if "ambiguous" not in message:
            message = f"invalid choice: {text!r} (see the list of models in --help)"
        raise argparse.ArgumentTypeError(message) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="surgery", description="Unfuse diffusion transformers' fused projections and shard them with stock torch TP.",
        formatter_class=_Formatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    epilog = _models_epilog()
    _demo_command(commands, epilog)
    _plan_command(commands, epilog)
    _inspect_command(commands, epilog)
    _explore_command(commands, epilog)
    _convert_command(commands, epilog)
    _families_command(commands)
    return parser


def _demo_command(commands, epilog: str) -> None:
    """`surgery demo`: the main job: a seeded model unfused, checked and sharded over CPU processes."""
    demo = commands.add_parser(
        "demo", formatter_class=_Formatter, epilog=epilog,
        help="unfuse a seeded model (default FLUX.2-klein-4B-shaped) and shard it over CPU processes (no downloads)",
        description="Builds a published model's shape at reduced depth and head size with seeded weights, unfuses it, "
        "checks it against the fused model, then runs tensor parallelism on N CPU processes (gloo) and prints "
        "errors, collectives, per-rank memory and timings.",
    )
    demo.add_argument("--model", type=_model, default="flux2-klein-4b", metavar="MODEL",
                      help="model to take the shape of (default flux2-klein-4b; any name listed below)")
    demo.add_argument("--tp", type=_ranks, default=2, help="CPU processes to shard over (default 2)")
    demo.add_argument("--layers", type=_between(1, 64, "blocks of a demo model"), help="double-stream blocks (family default: 2)")
    demo.add_argument("--single-layers", type=_between(1, 64, "blocks of a demo model"), help="single-stream blocks (family default: 4)")
    demo.add_argument("--head-dim", type=_between(1, 1024, "a demo head size"), help="head size (family default: 32)")
    demo.add_argument("--image-tokens", type=_between(1, 2**14, "tokens of a demo forward"), default=64)
    demo.add_argument("--text-tokens", type=_between(1, 2**14, "tokens of a demo forward"), default=32)
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    demo.add_argument("--seed", type=_between(0, 2**63 - 1, "torch.manual_seed's range"), default=0)


def _plan_command(commands, epilog: str) -> None:
    """`surgery plan`: per-rank layout, memory and collectives on one CPU."""
    plan = commands.add_parser(
        "plan", formatter_class=_Formatter, epilog=epilog,
        help="the per-rank layout, memory and collectives of a model at a TP size, on one CPU",
        description="Builds the model on the meta device, unfuses it and shards it under torch's fake process group "
        "(nothing is allocated, no accelerator needed), then prints each parameter's placement and per-rank shape, "
        "the bytes per rank, and the collectives of one forward. With --show-plan, prints the plan itself instead.",
    )
    _model_arguments(plan)
    plan.add_argument("--tp", type=_ranks, help="tensor-parallel size (required, except with --show-plan)")
    plan.add_argument("--cp", type=_ranks, default=1, help="context-parallel (Ulysses) size (default 1)")
    plan.add_argument("--dp", type=_ranks, default=1, help="FSDP2 data-parallel size (default 1)")
    plan.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    plan.add_argument("--image-tokens", type=_tokens, default=4096, help="default 4096 (a 1024x1024 image)")
    plan.add_argument("--text-tokens", type=_tokens, default=512)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--pipeline", action="store_true",
                      help="every component of the published pipeline (transformer, text encoders, VAE): bytes per "
                      "rank, sharded and replicated")
    plan.add_argument("--quant", choices=["int8", "fp8", "q4"],
                      help="GiB per rank with the sharded block Linears quantized (torchao int8 or float8 with per-row "
                      "scales, GGUF Q4_K), the rest in --dtype: at --tp, or at every TP from 1 to 8")
    plan.add_argument("--show-plan", action="store_true",
                      help="print the plan surgery.tensor_parallel applies, one block of each kind, as a literal dict "
                      "of stock torch styles: valid Python to edit and pass as tensor_parallel(model, mesh, plan=...) "
                      "(with --tp: checked to fit that size)")


def _inspect_command(commands, epilog: str) -> None:
    """`surgery inspect`: the rewrite table (and a diagram)."""
    inspect_parser = commands.add_parser(
        "inspect", formatter_class=_Formatter, epilog=epilog,
        help="the rewrite table of a model: which fused rows/columns each unfused Linear takes",
        description="Builds the model on the meta device and lists what surgery.unfuse rewrites: module, class before "
        "-> after, and the rows (views) or columns (copies) of the fused weight each new parameter takes.",
    )
    _model_arguments(inspect_parser)
    inspect_parser.add_argument("--all", action="store_true", help="one row per block instead of one per block kind")
    inspect_parser.add_argument("--svg", metavar="OUT.svg",
                         help="also draw one block's graph, fused -> unfused (-> one rank's with --tp), with Graphviz")
    inspect_parser.add_argument("--tp", type=_ranks, help="with --svg: add rank 0's local graph at this TP size")
    inspect_parser.add_argument("--module", help="with --svg: the module to draw (default: the fused one with most slices)")
    inspect_parser.add_argument("--panels", choices=["all", "fused", "unfused", "rank"], default="all",
                         help="with --svg: draw every form one above the other (default), or only one of them")
    inspect_parser.add_argument("--width", type=_between(1, 2**16, "pixels"), default=1000, metavar="PX",
                         help="with --svg: the page width to fit, in CSS px (default 1000, a notebook cell; a "
                         "README on a repository page gets about 880)")


def _explore_command(commands, epilog: str) -> None:
    """`surgery explore`: Google's Model Explorer on one block."""
    explore = commands.add_parser(
        "explore", formatter_class=_Formatter, epilog=epilog,
        help="open Google's Model Explorer on one block's graphs, with the TP plan's overlays",
        description="Traces one block (fused, unfused and, with --tp, rank 0's sharded graph) on the meta device, "
        "writes Model Explorer's graph JSON and node-data overlays (placement, bytes per rank, all-reduce bytes) to "
        "--out, and serves them on --host:--port. Needs the optional extra: pip install ai-edge-model-explorer.",
    )
    _model_arguments(explore)
    explore.add_argument("--tp", type=_ranks, help="add rank 0's local graph at this TP size")
    explore.add_argument("--module", help="the module to trace (default: the fused one with most slices)")
    explore.add_argument("--out", default="model_explorer", help="folder for the graph and overlay files")
    explore.add_argument("--host", default="127.0.0.1",
                         help="address the server listens on (default 127.0.0.1: this machine only)")
    explore.add_argument("--port", type=_port, default=8080, help="port the server listens on (default 8080)")
    explore.add_argument("--no-serve", action="store_true", help="only write the files")


def _convert_command(commands, epilog: str) -> None:
    """`surgery convert`: a checkpoint between layouts."""
    convert = commands.add_parser(
        "convert", formatter_class=_Formatter,
        help="rewrite a diffusers checkpoint into the unfused layout, or back (streaming, tensor by tensor)",
        description="Reads SRC (a diffusers model folder, a pipeline folder or a cached repo id 'org/name') and writes "
        "DST with the same config.json and the weights in the other layout, in diffusers' sharded layout (shards of "
        "at most --max-shard-size plus an index, or one file). Every tensor is checked against config.json first; "
        "DST is written into a temporary sibling folder and swapped in when complete. Memory: a few row blocks.",
    )
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--to", choices=["unfused", "fused"], default="unfused")
    convert.add_argument("--max-shard-size", default="10GB",
                         help="largest shard, as in save_pretrained (default 10GB, diffusers' default)")
    convert.add_argument("--variant", help="read and write diffusion_pytorch_model.<VARIANT>.safetensors (e.g. fp16)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a checkpoint already in DST (other files there are kept)")


def _families_command(commands) -> None:
    """`surgery families`: every diffusers transformer class, sharded or refused."""
    command = commands.add_parser(
        "families", formatter_class=_Formatter,
        help="every diffusers transformer class: sharded (all-reduces per forward, errors) or refused (the reason)",
        description="Prints what the conformance suite last proved (surgery/app/families.json; docs/families.md is "
        "this table): one row per class of diffusers.models.transformers, sharded (all-reduces per forward, the "
        "largest error at world 2 and 4) or refused (the reason). Builds nothing.",
    )
    command.add_argument("--rebuild", action="store_true",
                         help="plan every installed class anew instead: each built on meta (its family's default "
                         "published config, else the class's defaults), unfused and planned as tensor_parallel plans "
                         "it (minutes; no errors: those come from the conformance suite)")
    command.add_argument("--world", type=_ranks, default=2, help="ranks to plan for with --rebuild (default 2)")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", type=_model, default="flux2-klein-9b", metavar="MODEL",
                       help="default flux2-klein-9b; any name listed below")
    group.add_argument("--config", help="a diffusers transformer config.json instead (its _class_name picks the family)")


def _config(args: argparse.Namespace):
    """`(name, family, config)` from `--model` or `--config`; a bad config raises SurgeryError (one line)."""

    if args.config is None:
        family, variant = resolve_model(args.model)
        return family.model_name(variant), family, family.config(variant)
    try:
        with open(args.config) as f:
            raw = json.load(f)
    except (OSError, ValueError) as error:
        raise SurgeryError(f"--config {args.config}: {error}") from None
    if not isinstance(raw, dict):
        raise SurgeryError(f"--config {args.config}: expected a JSON object, got {type(raw).__name__}")
    class_name = raw.get("_class_name")
    family = next((f for f in families().values() if f.variants and _class_name(f) == class_name), None)
    if family is None:
        known = sorted(_class_name(f) for f in families().values() if f.variants)
        raise SurgeryError(f"--config {args.config}: _class_name {class_name!r} is no registered family's model "
                           f"class ({', '.join(known)})")
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    check_config(family, config)
    return args.config, family, config


def _class_name(family) -> str:
    cls = family.model_class
    return cls.rpartition(".")[2] if isinstance(cls, str) else cls.__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "inspect" and not args.svg and (args.tp or args.module or args.panels != "all"):
        parser.error("--tp, --module and --panels draw a diagram: add --svg OUT.svg")
    if args.command == "plan" and args.show_plan:
        extra = [flag for flag, given in (("--pipeline", args.pipeline), ("--json", args.json), ("--cp", args.cp > 1),
                                          ("--dp", args.dp > 1)) if given]
        if extra:
            parser.error(f"--show-plan prints the plan alone: drop {', '.join(extra)}")
    elif args.command == "plan" and args.quant is not None:
        extra = [flag for flag, given in (("--pipeline", args.pipeline), ("--cp", args.cp > 1), ("--dp", args.dp > 1))
                 if given]
        if extra:
            parser.error(f"--quant plans the transformer over TP alone: drop {', '.join(extra)}")
    elif args.command == "families" and args.world != 2 and not args.rebuild:
        parser.error("the proof is at world 2 (and 4): add --rebuild to plan for --world")
    elif args.command == "plan" and args.tp is None:
        parser.error("the following arguments are required: --tp")
    try:
        if args.command == "inspect" and args.svg:
            return _inspect_svg(args)
        if args.command == "explore":
            return _explore(args)
        if args.command == "plan" and args.show_plan:
            return _show_plan(args)
        if args.command in ("plan", "inspect"):
            return _plan_or_inspect(args)
        if args.command == "demo":
            return _demo(parser, args)
        if args.command == "families":
            print(coverage.rebuilt_table(args.world) if args.rebuild else listing())
            return 0
        if args.command == "convert":
            written = convert_checkpoint(args.src, args.dst, to=args.to, overwrite=args.overwrite,
                                         max_shard_size=args.max_shard_size, variant=args.variant)
            print(f"wrote {written}")
            return 0
    except (SurgeryError, OSError) as error:  # OSError: anything the checks could not foresee (a disk gone)
        parser.exit(1, f"surgery {args.command}: {' '.join(str(error).split())}\n")
    except Exception as error:  # noqa: BLE001 - a command line never ends in a traceback; this one is a bug to report
        text = " ".join(str(error).split())[:300]
        parser.exit(1, f"surgery {args.command}: unexpected {type(error).__name__}: {text} (a bug in surgery: please "
                       "report it with this command line)\n")
    except KeyboardInterrupt:
        if args.command != "convert":
            raise
        parser.exit(130, f"surgery convert: interrupted; '{args.dst}' is as it was.\n")
    return 2


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("layers", args.layers), ("single_layers", args.single_layers),
                                   ("head_dim", args.head_dim)) if v is not None}
    try:
        config = demo_config(args.model, **overrides)
    except (SurgeryError, TypeError) as error:
        parser.error(f"--model {args.model}: {error}")
    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % args.tp:
        parser.error(f"--tp {args.tp} does not divide the {heads} heads of {args.model}")
    return run(args.model, args.tp, args.seed, args.dtype, args.image_tokens, args.text_tokens, **overrides)


def _plan_or_inspect(args: argparse.Namespace) -> int:
    name, family, config = _config(args)
    if args.command == "inspect":
        model = report.model_on_meta(family, config)
        rows = report.rewrite_table(model)
        if not args.all:
            rows = report.collapse_blocks(rows, "module", also=("parameter",))
        if not rows:
            print(f"{name}: nothing to rewrite — the {family.name} family fuses no projections (plans only: "
                  f"tensor_parallel shards it as it is). Its per-rank layout: surgery plan --model {name} --tp N")
            return 0
        print(f"{name}: what surgery.unfuse rewrites (rows are views of the fused weight, columns are copies)\n")
        print(render.text_table(rows))
        return 0
    if args.quant is not None:
        tps = [args.tp] if args.tp is not None else range(1, 9)
        result = report.quantized_plan(config, tps, args.quant, family=family, dtype=getattr(torch, args.dtype))
        print(json.dumps(result, indent=1) if args.json else report.quantized_plan_text(name, result))
        return 0
    if args.pipeline:
        if args.config is not None or args.cp > 1 or args.dp > 1:
            raise SurgeryError("plan --pipeline takes --model (a published pipeline) and --tp only, not --config, "
                               "--cp or --dp.")
        result = pipeline_plan(name, args.tp, dtype=getattr(torch, args.dtype))
        print(json.dumps(result, indent=1, default=str) if args.json else pipeline_plan_text(result))
        return 0
    result = report.plan(config, args.tp, family=family, dtype=getattr(torch, args.dtype),
                          image_tokens=args.image_tokens, text_tokens=args.text_tokens, cp=args.cp, dp=args.dp)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(render.plan_text(name, result))
        if args.cp > 1 or args.dp > 1:
            print(_mesh_lines(result))
    return 0


def _show_plan(args: argparse.Namespace) -> int:
    """`plan --show-plan`: the effective plan of the first block of each kind, its keys made `<list>.*.<key>` so that
    the printed dict, passed as `plan=`, shards every block of the kind alike (a kind whose blocks' plans differ is
    written out block by block)."""

    name, family, config = _config(args)
    model = unfuse(model_on_meta(family, config))
    checked_plan(model, None, None, args.tp or 1)  # no plan at all, or (with --tp) sizes the mesh cannot split
    kinds: dict[str, dict[str, dict]] = {}  # kind -> block -> {key after the block: style}
    for key, style in effective_plan(model).items():
        block, _ = block_path(model, key)
        kinds.setdefault(wildcard_path(model, block), {}).setdefault(block, {})[key[len(block):]] = style
    plan, comments = {}, {}
    for kind, blocks in kinds.items():
        first, *rest = blocks
        sources = {b: [(k, style_source(v)) for k, v in entries.items()] for b, entries in blocks.items()}
        alike = all(sources[b] == sources[first] for b in rest)
        what = type(model.get_submodule(first)).__name__
        for block in [first] if alike else blocks:
            entries = {(kind if alike else block) + key: style for key, style in blocks[block].items()}
            comments[next(iter(entries))] = (
                f"{kind}: {len(blocks)} x {what}, as {first}" if alike and rest else
                f"{block}: {what}" + ("" if alike else f" ({kind}'s blocks differ: each is written out)"))
            plan.update(entries)
    size = f", checked at --tp {args.tp}" if args.tp is not None else " (the same at every TP size)"
    print(f"# surgery.tensor_parallel's plan for {name}{size}: one block of each kind, '*' standing for\n"
          "# every block of its list. Edit it, then pass it: tensor_parallel(model, mesh, plan=...). Its names:\n"
          "# from torch.distributed.tensor import *; from torch.distributed.tensor.parallel import *;\n"
          "# from surgery.parallel.styles import *; from surgery.parallel.derive import *")
    print(plan_source(plan, comments))
    return 0


def _block_forms(args: argparse.Namespace):
    """The model of --model/--config on meta (bf16), and its example inputs at 1024x1024 (4096 image + 512 text)."""


    name, family, config = _config(args)
    model = model_on_meta(family, config, torch.bfloat16)
    inputs = family.example_inputs(config, image_tokens=4096, text_tokens=512, dtype=torch.bfloat16, device="meta")
    return name, model, inputs


def _inspect_svg(args: argparse.Namespace) -> int:
    name, model, inputs = _block_forms(args)
    graphs = forms.forms(model, inputs, module=args.module, tp=args.tp)
    if args.panels != "all":
        graphs = [g for g in graphs if g.title.startswith(args.panels)]
        if not graphs:
            raise SurgeryError(f"--panels {args.panels}: the diagram has no such panel"
                               + (" (add --tp N for a rank's)" if args.panels == "rank" else ""))
    if not diagram.dot_available():
        print(diagram.text(graphs))
        raise SurgeryError(f"wrote no {args.svg}: {diagram.HOW_TO_GET_DOT}")
    diagram.write_svg(graphs, args.svg, title=f"{name} (bf16, 4096 image + 512 text tokens)",
                      max_width_px=args.width)
    with open(args.svg) as f:
        width, height = svg.svg_size_px(f.read())
    print(f"wrote {args.svg} ({width:.0f} x {height:.0f} px): " + "; ".join(
        f"{row['graph']}: {row['nodes']} nodes" for row in diagram.summary(graphs)))
    return 0


def _explore(args: argparse.Namespace) -> int:
    name, model, inputs = _block_forms(args)
    files = explorer.explore(model, inputs, module=args.module, tp=args.tp, out_dir=args.out, serve=False)
    print(f"wrote {files['graphs']} and {len(files['node_data'])} overlays ({', '.join(files['node_data'])})",
          flush=True)
    if not args.no_serve:  # said before the server blocks, not after Ctrl-C

        print(f"serving Model Explorer on http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
        explorer.serve_files(files, host=args.host, port=args.port)
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
