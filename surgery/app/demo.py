"""`surgery demo`: unfuse a seeded model of any registered family and shard it over CPU ranks, with no downloads."""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.core.build import sample, tuple_output
from surgery.core.registry import Family, families, resolve_model
from surgery.sight.render import mb
from surgery.sight.report import local_bytes
from surgery.testing import CollectiveCounter, rel_err, run_on_cpu_ranks, seeded_model


def quiet_diffusers_deprecations() -> None:
    """Silence the deprecation warnings diffusers raises against its own code when the demo builds a model (Chroma's
    `FluxPosEmbed` import), which the user can do nothing about; warnings about the user's own calls stay."""
    warnings.filterwarnings("ignore", message=r".*`FluxPosEmbed` is deprecated", category=FutureWarning)


def demo_config(model: str = "flux2-klein-4b", **overrides) -> dict:
    """A published config at demo size (the family's `reduced`: same head count, fewer blocks, smaller heads)."""
    family, variant = resolve_model(model)
    config = family.config(variant)
    return family.shrink_config(config, **overrides) if family.shrink_config else config


def _timed_forward(model, inputs: dict, repeats: int = 3) -> tuple[torch.Tensor, float]:
    """One warm-up forward, then the median of `repeats` timed ones."""
    times = _interleaved([model], inputs, repeats)[0]
    with torch.no_grad():
        out = sample(model, **inputs)
    return out, times


def _interleaved(models: list, inputs: dict, repeats: int = 5) -> list[float]:
    """Median forward seconds of each model, one warm-up each, then the models timed in turn (so a busy moment of
    the machine falls on all of them alike)."""
    times: list[list[float]] = [[] for _ in models]
    calls = [{**inputs, **tuple_output(model)} for model in models]  # read once: the timed loop runs the forward only
    with torch.no_grad():
        for model, kwargs in zip(models, calls):
            model(**kwargs)
        for _ in range(repeats):
            for i, (model, kwargs) in enumerate(zip(models, calls)):
                started = time.perf_counter()
                model(**kwargs)
                times[i].append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def tp_rank(rank: int, world: int, family_name: str, config: dict, seed: int, dtype_name: str,
            tokens: tuple[int, int]) -> dict:
    """One CPU rank of the demo: fused reference, unfuse, tensor_parallel, compare, count."""



    quiet_diffusers_deprecations()
    family = families()[family_name]
    dtype = getattr(torch, dtype_name)
    fused = seeded_model(family, config, seed, dtype)
    inputs = family.example_inputs(config, image_tokens=tokens[0], text_tokens=tokens[1], seed=seed, dtype=dtype)
    expected, fused_seconds = _timed_forward(fused, inputs)

    model = surgery.unfuse(fused)  # in place: no second copy of the model (at published width one costs GBs)
    del fused
    started = time.perf_counter()
    surgery.tensor_parallel(model, init_device_mesh("cpu", (world,)), src_data_rank=None)
    shard_seconds = time.perf_counter() - started
    with torch.no_grad(), CollectiveCounter() as counter:
        model(**inputs, **tuple_output(model))  # one forward, counted
    out, tp_seconds = _timed_forward(model, inputs)
    sharded = [p.nbytes for p in model.parameters() if isinstance(p, DTensor)]
    return {
        "error": rel_err(out, expected),
        "collectives": dict(counter.counts),
        "collective_bytes": counter.bytes,
        "local_bytes": local_bytes(model),
        "sharded_global_bytes": sum(sharded),
        "fused_seconds": fused_seconds,
        "tp_seconds": tp_seconds,
        "shard_seconds": shard_seconds,
    }


def _describe(family: Family, config: dict) -> str:
    keys = [k for k in config if k.startswith("num_") or k.endswith(("head_dim", "_heads"))]
    return ", ".join(f"{k}={config[k]}" for k in keys)


def run(model: str, tp: int, seed: int, dtype: str, image_tokens: int, text_tokens: int, **overrides) -> int:
    quiet_diffusers_deprecations()
    family, variant = resolve_model(model)
    config = demo_config(model, **overrides)
    torch_dtype = getattr(torch, dtype)
    fused = seeded_model(family, config, seed, torch_dtype)
    params = sum(p.numel() for p in fused.parameters())
    print(f"surgery demo: {family.model_name(variant)} shape at demo size ({_describe(family, config)}), "
          f"{params / 1e6:.1f}M parameters, {dtype}, seed {seed}")

    inputs = family.example_inputs(config, image_tokens=image_tokens, text_tokens=text_tokens, seed=seed,
                                   dtype=torch_dtype)
    expected, fused_seconds = _timed_forward(fused, inputs)
    started = time.perf_counter()
    unfused = surgery.unfuse(fused)  # in place: the fused output is kept, not a second copy of the model
    seconds = time.perf_counter() - started
    records = surgery.core.rewrite.last_report(unfused)
    copied = sum(r.bytes_copied for r in records)
    print(f"\nunfuse: {len(records)} modules rewritten in {seconds * 1e3:.1f} ms; {mb(copied)} copied "
          "(column splits); every row slice is a view of the fused weight")
    for record in records:
        print(f"  {record.path:<36} {record.before} -> {record.after}")

    out, unfused_seconds = _timed_forward(unfused, inputs)
    print(f"\nsingle device (this process, {torch.get_num_threads()} threads): max relative error unfused vs fused "
          f"{rel_err(out, expected):.2e}; forward fused {fused_seconds * 1e3:.0f} ms, unfused "
          f"{unfused_seconds * 1e3:.0f} ms (medians of 3; unfuse works in place, so the two are timed one after "
          "the other)")
    whole = sum(p.numel() for p in unfused.parameters()) * (torch.finfo(torch_dtype).bits // 8)
    del fused, unfused

    print(f"\ntensor_parallel over {tp} CPU ranks (gloo), src_data_rank=None:")
    results = run_on_cpu_ranks(tp_rank, tp, family.name, config, seed, dtype, (image_tokens, text_tokens))
    for rank, r in enumerate(results):
        counts = ", ".join(f"{n} {op}" for op, n in r["collectives"].items()) or "none"
        print(f"  rank {rank}: max relative error vs fused single device {r['error']:.2e}; collectives per forward: "
              f"{counts} ({mb(r['collective_bytes'])}); parameters {mb(r['local_bytes'])}; "
              f"forward under TP {r['tp_seconds'] * 1e3:.0f} ms")
    sharded = results[0]["sharded_global_bytes"]
    expected_collectives = f"{family.tp.all_reduces(config)} all-reduces" if family.tp.all_reduces else "(not declared)"
    print(f"  expected: {expected_collectives} per forward; {mb(whole - sharded)} replicated + {mb(sharded)} "
          f"sharded / {tp} = {mb(whole - sharded + sharded // tp)} per rank")
    print(f"  (TP forwards: medians of 3 with the {tp} ranks running at once on this machine's "
          f"{os.cpu_count()} cores, so not comparable with the single-device times above; see benchmarks/)")
    worst = max(r["error"] for r in results)
    tolerance = 1e-5 if torch_dtype == torch.float32 else 3e-2
    print(f"\n{'OK' if worst <= tolerance else 'MISMATCH'}: worst error {worst:.2e} (tolerance {tolerance:g})")
    return 0 if worst <= tolerance else 1
