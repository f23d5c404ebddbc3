"""FLUX.2 on 2-D meshes: TP4 vs CP4 (diffusers' Ulysses) vs TP2 x CP2 per forward, measured in one CPU run, and the
all-to-all volume of Ulysses on paper for FLUX.2-dev at 1024^2 and 2048^2.

    python benchmarks/two_d_mesh.py            # CPU, 4 gloo processes; a few minutes on 2 cores
    python benchmarks/two_d_mesh.py --smoke    # seconds: tiny sizes, one repeat (timings meaningless)

Each rank holds the same seeded model; every layout runs the unfused model (so only the parallelism differs) on the
same inputs, interleaved, medians after warm-up. Errors are against the single-device fused model. The on-paper
part runs `surgery.sight.report.plan` (meta device, fake process group: nothing allocated). Results go to
benchmarks/results/ as JSON and markdown; the script exits non-zero only when it fails to run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import surgery  # noqa: E402
from flux2 import _markdown, interleaved, machine  # noqa: E402
from surgery_rewrites.flux2 import example_inputs, seeded_model  # noqa: E402
from surgery.sight import report, render  # noqa: E402
from surgery.app.demo import demo_config  # noqa: E402
from surgery.testing import CollectiveCounter, rel_err, run_on_cpu_ranks  # noqa: E402

WORLD = 4
LAYOUTS = {"TP4": (1, 4), "CP4": (4, 1), "TP2 x CP2": (2, 2)}  # name -> (cp, tp)


def cp_inputs(config: dict, image_tokens: int, text_tokens: int) -> dict:
    kw = example_inputs(config, image_tokens=image_tokens, text_tokens=text_tokens)
    kw["img_ids"], kw["txt_ids"] = kw["img_ids"].unsqueeze(0), kw["txt_ids"].unsqueeze(0)
    return dict(kw, return_dict=False)


def layout(model: torch.nn.Module, cp: int, tp: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    model = surgery.unfuse(copy.deepcopy(model))
    if tp > 1:
        surgery.tensor_parallel(model, mesh["tp"], src_data_rank=None)
    if cp > 1:
        surgery.context_parallel(model, mesh["cp"])
    return model


def rank_run(rank: int, world: int, config: dict, tokens: tuple[int, int], repeats: int, warmup: int) -> dict:
    fused = seeded_model(config, 0)
    kw = cp_inputs(config, *tokens)
    models = {name: layout(fused, cp, tp) for name, (cp, tp) in LAYOUTS.items()}
    result = {"times": interleaved(models, kw, repeats, warmup)}
    with torch.no_grad():
        expected = fused(**kw)[0]
        for name, model in models.items():
            with CollectiveCounter() as counter:
                out = model(**kw)[0]
            result[name] = {"error": rel_err(out, expected), "ops": dict(counter.counts), "bytes": counter.bytes,
                            "param bytes": report.local_bytes(model)}
    return result


def measured(args) -> list[dict]:
    config = demo_config("flux2-klein-4b") if not args.smoke else demo_config("flux2-klein-4b", layers=1, single_layers=1, head_dim=8)
    tokens = (args.image_tokens, args.text_tokens)
    rank0 = run_on_cpu_ranks(rank_run, WORLD, config, tokens, args.repeats, args.warmup)[0]
    t = rank0["times"]
    model = (f"klein-4b shape (24 heads), head_dim {config['attention_head_dim']}, {config['num_layers']}+"
             f"{config['num_single_layers']} blocks, fp32, {tokens[0]} + {tokens[1]} tokens")
    rows = []
    for name in LAYOUTS:
        r = rank0[name]
        rows.append({
            "model": model, "layout": name, "forward ms": t[name] * 1e3, "/ TP4": t[name] / t["TP4"],
            "collectives": ", ".join(f"{n} {op}" for op, n in sorted(r["ops"].items())),
            "collective input bytes": render.mb(r["bytes"]), "param bytes / rank": render.mb(r["param bytes"]),
            "max rel err": r["error"],
        })
    return rows


def on_paper(args) -> list[dict]:
    """FLUX.2-dev (48 heads) on 8 ranks, bf16, batch 1: what Ulysses moves next to TP's all-reduces, per forward.

    Byte columns are each rank's collective input tensors; of an all-to-all's input, (cp - 1) / cp leaves the rank.
    """
    rows = []
    resolutions = {"1024^2": 4096, "2048^2": 16384} if not args.smoke else {"1024^2": 4096}
    layouts = [(8, 1), (4, 2), (2, 4), (1, 8)] if not args.smoke else [(4, 2)]
    for resolution, image_tokens in resolutions.items():
        for tp, cp in layouts:
            p = report.plan("flux2-dev", tp, cp=cp, image_tokens=image_tokens, text_tokens=512)
            c = p["collectives"]
            ops, by_op = c["ops"], c.get("bytes_by_op", {})
            rows.append({
                "model": "dev", "image": resolution, "tokens": image_tokens + 512, "TP": tp, "CP": cp,
                "bytes / rank": render.mb(p["bytes_per_rank"]),
                "all-to-alls": ops.get("all_to_all_single", 0),
                "all-to-all input / rank": render.mb(by_op.get("all_to_all_single", 0)),
                "leaves the rank": render.mb(by_op.get("all_to_all_single", 0) * (cp - 1) // cp),
                "all-reduces": ops.get("all_reduce", 0), "all-reduce / rank": render.mb(by_op.get("all_reduce", 0)),
                "all-gathers": ops.get("all_gather_into_tensor", 0),
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per layout (default 3; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 1; smoke 0)")
    parser.add_argument("--image-tokens", type=int, default=None, help="default 512 (smoke 16)")
    parser.add_argument("--text-tokens", type=int, default=None, help="default 128 (smoke 8)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 1)
    args.image_tokens = args.image_tokens or (16 if args.smoke else 512)
    args.text_tokens = args.text_tokens or (8 if args.smoke else 128)

    results = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(render.text_table([results["machine"]]))
    markdown = [f"# FLUX.2 on 2-D meshes ({results['machine']['date']})", "", _markdown([results["machine"]])]
    for title, section in [("TP4 vs CP4 vs TP2 x CP2 (CPU, 4 gloo processes)", measured),
                           ("Ulysses all-to-all on paper (FLUX.2-dev, 8 ranks, bf16)", on_paper)]:
        started = time.perf_counter()
        rows = section(args)
        results[title] = rows
        print(f"\n## {title} ({time.perf_counter() - started:.0f} s)\n{render.text_table(rows)}", flush=True)
        markdown += ["", f"## {title}", "", _markdown(rows)]

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"two-d-mesh-cpu{'-smoke' if args.smoke else ''}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / f"{stem}.md").write_text("\n".join(markdown) + "\n")
    print(f"\nwrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
