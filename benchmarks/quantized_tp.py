"""torchao quantization with tensor parallelism, on CPU processes (gloo): error against the whole quantized model,
bytes per rank, ms per forward, for each quantization quantized before and after `surgery.tensor_parallel`.

    python benchmarks/quantized_tp.py                # FLUX.2 klein-4B width, 1 double + 1 single block, TP 2
    python benchmarks/quantized_tp.py --tp 4 --variant dev
    python benchmarks/quantized_tp.py --smoke        # seconds: a tiny model

Per quantization (torchao 0.18: int8 weight-only, int8 dynamic activation, float8 weight-only), every rank:
the unfused model quantized whole (the reference, run on each rank alone); the same model quantized, then
`tensor_parallel` ("before"); `tensor_parallel`, then quantized ("after"). Reported: max |out - whole| / max |whole|,
parameter bytes this rank holds (quantized weights counted by what they store: int8/fp8 values and scales), and the
median ms of 3 forwards after one warm-up. Timings on a shared 2-core machine mean little; the errors and bytes do
not depend on it. Results go to benchmarks/results/quantized_tp.{json,md}.

Measured (smoke, TP 2, 2 shared cores): int8 weight-only 3.6e-7 before and after TP, 246,160 of 395,152 bytes per
rank; float8 weight-only 2.5e-7, 242,368 of 389,824; int8 dynamic activation 8.1e-3 in both orders — dynamic
activation quantization rounds activations to int8 per token, so float noise moves the whole model itself that far
(1.5e-2 under 1e-7 relative input noise, tests/parallel/test_quantized_tp.py), while one colwise + rowwise pair matches at
1.0e-7.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import surgery  # noqa: E402
from surgery.parallel.quantized import held_bytes  # noqa: E402
from surgery.testing import rel_err, run_on_cpu_ranks  # noqa: E402


def configs() -> dict:
    from torchao.quantization import (Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                      Int8WeightOnlyConfig)

    return {"int8 weight-only": Int8WeightOnlyConfig(), "int8 dynamic activation": Int8DynamicActivationInt8WeightConfig(),
            "float8 weight-only": Float8WeightOnlyConfig()}


def model_and_inputs(args):
    from surgery_rewrites.flux2 import FAMILY, example_inputs, seeded_model

    config = (dict(FAMILY.tests.configs["tp_wide"]) if args.smoke
              else dict(FAMILY.config(args.variant), num_layers=1, num_single_layers=1))
    tokens = (16, 8) if args.smoke else (256, 64)
    model = surgery.unfuse(seeded_model(config, 0, torch.float32))
    kw = example_inputs(config, batch=1, image_tokens=tokens[0], text_tokens=tokens[1], seed=0, dtype=torch.float32)
    return model, kw


def timed(model, kw) -> tuple[torch.Tensor, float]:
    times = []
    with torch.no_grad():
        out = model(**kw, return_dict=False)[0]
        for _ in range(3):
            start = time.perf_counter()
            model(**kw, return_dict=False)
            times.append((time.perf_counter() - start) * 1e3)
    return out, statistics.median(times)


def rank_job(rank: int, world: int, args) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.quantization import quantize_

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    unfused, kw = model_and_inputs(args)
    rows = []
    for name, config in configs().items():
        whole = copy.deepcopy(unfused)
        quantize_(whole, config)
        expected, whole_ms = timed(whole, kw)
        before = copy.deepcopy(unfused)
        quantize_(before, config)
        surgery.tensor_parallel(before, mesh)
        got_before, before_ms = timed(before, kw)
        after = surgery.tensor_parallel(copy.deepcopy(unfused), mesh)
        quantize_(after, config)
        got_after, after_ms = timed(after, kw)
        rows.append({"quantization": name, "rank": rank, "error before TP": rel_err(got_before, expected),
                     "error after TP": rel_err(got_after, expected), "whole bytes": held_bytes(whole),
                     "bytes per rank": held_bytes(before), "bytes per rank (after)": held_bytes(after),
                     "whole ms": whole_ms, "TP ms": before_ms, "TP ms (after)": after_ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--variant", default="klein-4b")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    rows = [row for rank_rows in run_on_cpu_ranks(rank_job, args.tp, args) for row in rank_rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "quantized_tp-smoke" if args.smoke else "quantized_tp"
    (out / f"{stem}.json").write_text(json.dumps({"tp": args.tp, "variant": args.variant, "smoke": args.smoke,
                                                  "torch": torch.__version__, "rows": rows}, indent=1))
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.2e}" if isinstance(v, float) and "error" in k else
                                       f"{v:.1f}" if isinstance(v, float) else str(v) for k, v in row.items()) + " |")
    (out / f"{stem}.md").write_text(f"# Quantized TP {args.tp} ({'smoke' if args.smoke else args.variant})\n\n"
                                    + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
