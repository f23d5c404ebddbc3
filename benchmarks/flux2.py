"""Side by side: fused vs unfused, and surgery's TP vs diffusers' packed TP, as ratios measured in one run.

    python benchmarks/flux2.py                 # CPU, FLUX.2 klein widths: about 8 minutes on 2 cores
    python benchmarks/flux2.py --model flux1-dev   # any registered family (`surgery plan --help` lists the names)
    python benchmarks/flux2.py --smoke         # seconds: tiny sizes, one repeat (what CI runs; timings meaningless)
    python benchmarks/flux2.py --device cuda   # one GPU: the full-size model (default klein-9B) in bf16, eager and
                                               # torch.compile

Timings are medians of interleaved repeats after warm-up. Results go to benchmarks/results/ as JSON and markdown.
The script exits non-zero only when it fails to run, never because a number is bad.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import surgery  # noqa: E402
from surgery.testing import CollectiveCounter, run_on_cpu_ranks  # noqa: E402
from surgery.sight import report, render  # noqa: E402
from surgery.core.registry import families, model_class, resolve_model  # noqa: E402
from surgery.testing import rel_err, seeded_model  # noqa: E402


def machine() -> dict:
    import diffusers

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cpu cores": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(models: dict, inputs: dict, repeats: int, warmup: int, device: str = "cpu") -> dict[str, float]:
    """Median seconds per forward of each model, runs interleaved so drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for _ in range(warmup):
            for model in models.values():
                model(**inputs)
        for _ in range(repeats):
            for name, model in models.items():
                _sync(device)
                started = time.perf_counter()
                model(**inputs)
                _sync(device)
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def width_config(model: str, layers: int, single_layers: int, smoke: bool = False) -> tuple:
    """`(family, config)`: a published config at full width and reduced depth (smoke: tiny heads too)."""
    family, variant = resolve_model(model)
    config = family.config(variant)
    head_dim = 8 if smoke else config.get("attention_head_dim")
    return family, family.shrink_config(config, layers=layers, single_layers=single_layers, head_dim=head_dim)


def single_device(args) -> list[dict]:
    """Forward time, fused vs unfused, at real widths and reduced depth."""
    rows = []
    shapes = [(m, 1, 2) for m in args.models] if not args.smoke else [(args.models[0], 1, 1)]
    for name, layers, single in shapes:
        family, config = width_config(name, layers, single, args.smoke)
        for dtype in (torch.float32, torch.bfloat16):
            fused = seeded_model(family, config, 0, dtype)
            unfused = surgery.unfuse(copy.deepcopy(fused))
            kw = family.example_inputs(config, image_tokens=args.image_tokens, text_tokens=args.text_tokens,
                                       dtype=dtype)
            t = interleaved({"fused": fused, "unfused": unfused}, kw, args.repeats, args.warmup)
            with torch.no_grad():
                error = rel_err(unfused(**kw, return_dict=False)[0], fused(**kw, return_dict=False)[0])
            rows.append({
                "model": f"{name} width, {layers}+{single} blocks", "dtype": str(dtype)[6:],
                "tokens": args.image_tokens + args.text_tokens, "fused ms": t["fused"] * 1e3,
                "unfused ms": t["unfused"] * 1e3, "unfused / fused": t["unfused"] / t["fused"], "max rel err": error,
            })
            del fused, unfused
    return rows


def unfuse_cost(args) -> list[dict]:
    """Wall time and bytes copied by unfuse: a real-width model at reduced depth, and full-size configs on meta."""
    rows = []
    surgery.core.registry.registered()  # load the rewrite registry first: not part of unfuse's cost
    family, config = width_config(args.models[0], 1, 2 if not args.smoke else 1, args.smoke)
    for dtype in (torch.float32, torch.bfloat16):
        model = seeded_model(family, config, 0, dtype)
        size = sum(p.nbytes for p in model.parameters())
        started = time.perf_counter()
        surgery.unfuse(model)
        seconds = time.perf_counter() - started
        copied = sum(r.bytes_copied for r in surgery.core.rewrite.last_report(model))
        rows.append({"model": f"{args.models[0]} width, {config.get('num_layers')}+{config.get('num_single_layers')} "
                     "blocks",
                     "device": "cpu", "dtype": str(dtype)[6:], "model bytes": render.mb(size),
                     "unfuse ms": seconds * 1e3, "bytes copied": render.mb(copied), "copied / model": copied / size})
    for name in args.models if not args.smoke else args.models[:1]:
        family, variant = resolve_model(name)
        model = report.model_on_meta(family, family.config(variant))
        started = time.perf_counter()
        surgery.unfuse(model)
        rows.append({"model": f"{name} full size", "device": "meta", "dtype": "float32", "model bytes": "-",
                     "unfuse ms": (time.perf_counter() - started) * 1e3, "bytes copied": "0 (meta)",
                     "copied / model": 0.0})
    return rows


def tp_rank(rank: int, world: int, family_name: str, config: dict, tokens: tuple[int, int], repeats: int,
            warmup: int) -> dict:
    """One gloo rank: single-device fused, surgery's TP and diffusers' packed TP (where diffusers has a plan for the
    model) on the same model and inputs."""
    from torch.distributed.device_mesh import init_device_mesh

    from surgery.testing import diffusers_packed_tp

    family = families()[family_name]
    mesh = init_device_mesh("cpu", (world,))
    fused = seeded_model(family, config, 0)
    kw = family.example_inputs(config, image_tokens=tokens[0], text_tokens=tokens[1])
    ours = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh, src_data_rank=None)
    models = {"fused (1 device)": fused, "surgery TP": ours}
    if getattr(model_class(family), "_tp_plan", None) is not None:
        models["diffusers packed TP"] = diffusers_packed_tp(copy.deepcopy(fused), mesh)
    result = {"times": interleaved(models, kw, repeats, warmup)}
    with torch.no_grad():
        expected = fused(**kw, return_dict=False)[0]
        for name in [n for n in models if "TP" in n]:
            with CollectiveCounter() as counter:
                out = models[name](**kw, return_dict=False)[0]
            result[name] = {
                "collectives": counter.total, "bytes": counter.bytes, "error": rel_err(out, expected),
                "param bytes": report.local_bytes(models[name]),
            }
    return result


def tensor_parallel_cpu(args) -> list[dict]:
    """gloo TP at world 1/2/4 on CPU: ours vs diffusers' packed plan vs the single-device fused model."""
    from surgery.app.demo import demo_config

    name = args.models[0]
    family, _ = resolve_model(name)
    smoke = dict(layers=1, single_layers=1, head_dim=8) if args.smoke else {}
    config = demo_config(name, **smoke)
    tokens = (args.image_tokens, args.text_tokens)
    model = f"{name} shape at demo size, fp32"
    rows = []
    for world in args.worlds:
        rank0 = run_on_cpu_ranks(tp_rank, world, family.name, config, tokens, args.repeats, args.warmup)[0]
        t = rank0["times"]
        for plan in [n for n in rank0 if "TP" in n]:
            r = rank0[plan]
            rows.append({
                "model": model, "world": world, "plan": plan, "forward ms": t[plan] * 1e3,
                "/ fused 1 device": t[plan] / t["fused (1 device)"],
                "/ diffusers": t[plan] / t["diffusers packed TP"] if "diffusers packed TP" in t else "-",
                "collectives": r["collectives"],
                "all-reduced": render.mb(r["bytes"]), "param bytes / rank": render.mb(r["param bytes"]),
                "max rel err": r["error"],
            })
    return rows


def on_paper(args) -> list[dict]:
    """Per-rank memory and all-reduce volume per denoising step at 1024x1024, from the fake-process-group planner."""
    rows = []
    for name in args.models if not args.smoke else args.models[:1]:
        for tp in (2, 4, 8) if not args.smoke else (2,):
            p = report.plan(name, tp)
            rows.append({
                "model": name, "TP": tp, "bytes / rank (bf16)": render.mb(p["bytes_per_rank"]),
                "replicated": render.mb(p["replicated_bytes"]), "sharded / TP": render.mb(p["sharded_bytes"] // tp),
                "all-reduces / step": p["collectives"]["total"],
                "all-reduced / step": render.mb(p["collectives"]["bytes"]),
            })
    return rows


def cuda_full_size(args) -> list[dict]:
    """A full-size model (default klein-9B) in bf16 on one GPU: fused vs unfused, eager and torch.compile (regional)."""
    family, variant = resolve_model(args.models[0])
    config = family.config(variant)
    if args.smoke:
        config = family.shrink_config(config, layers=1, single_layers=1, head_dim=config.get("attention_head_dim"))
    with torch.device("cuda"), report.default_dtype(torch.bfloat16):
        fused = model_class(family)(**config).eval()
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5) if p.dim() > 1 else p.normal_(1.0, 0.1)
    unfused = surgery.unfuse(copy.deepcopy(fused))
    kw = family.example_inputs(config, image_tokens=4096, text_tokens=512, dtype=torch.bfloat16, device="cuda")
    rows = []
    for mode in ("eager", "compile"):
        if mode == "compile":
            for model in (fused, unfused):
                model.compile_repeated_blocks()
        started = time.perf_counter()
        t = interleaved({"fused": fused, "unfused": unfused}, kw, args.repeats, max(args.warmup, 2), "cuda")
        with torch.no_grad():
            error = rel_err(unfused(**kw, return_dict=False)[0], fused(**kw, return_dict=False)[0])
        rows.append({"model": f"{args.models[0]} full size", "dtype": "bfloat16", "mode": mode, "tokens": 4608,
                     "fused ms": t["fused"] * 1e3, "unfused ms": t["unfused"] * 1e3,
                     "unfused / fused": t["unfused"] / t["fused"], "max rel err": error,
                     "section s": time.perf_counter() - started,
                     "peak GiB": torch.cuda.max_memory_allocated() / 2**30})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", dest="models", nargs="+", default=None,
                        help="models to measure (default: flux2-klein-4b flux2-klein-9b on CPU, flux2-klein-9b on CUDA; "
                        "the first one is the one sharded)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per model (default 3; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 1; smoke 0)")
    parser.add_argument("--image-tokens", type=int, default=None)
    parser.add_argument("--text-tokens", type=int, default=None)
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="CPU TP sizes (default 1 2 4)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 1)
    args.image_tokens = args.image_tokens or (16 if args.smoke else 128)
    args.text_tokens = args.text_tokens or (8 if args.smoke else 32)
    args.worlds = args.worlds or ([1, 2] if args.smoke else [1, 2, 4])
    args.models = args.models or (["flux2-klein-9b"] if args.device == "cuda" else ["flux2-klein-4b", "flux2-klein-9b"])
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")

    results = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(render.text_table([results["machine"]]))
    sections = [("single device", single_device), ("unfuse cost", unfuse_cost),
                ("tensor parallel (CPU, gloo)", tensor_parallel_cpu), ("memory per rank on paper", on_paper)]
    if args.device == "cuda":
        sections = [("single device, CUDA, full size", cuda_full_size), ("unfuse cost", unfuse_cost)]
    markdown = [f"# {', '.join(args.models)} benchmarks ({results['machine']['date']})", "", _markdown([results["machine"]])]
    for title, section in sections:
        started = time.perf_counter()
        rows = section(args)
        results[title] = rows
        print(f"\n## {title} ({time.perf_counter() - started:.0f} s)\n{render.text_table(rows)}", flush=True)
        markdown += ["", f"## {title}", "", _markdown(rows)]

    args.out.mkdir(parents=True, exist_ok=True)
    prefix = "flux2" if args.models[0].startswith("flux2") else args.models[0]
    stem = f"{prefix}-{args.device}{'-smoke' if args.smoke else ''}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / f"{stem}.md").write_text("\n".join(markdown) + "\n")
    print(f"\nwrote {args.out / stem}.json and .md")
    return 0


def _markdown(rows: list[dict]) -> str:
    columns = list(rows[0].keys())
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
