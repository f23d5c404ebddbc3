"""Whole pipelines under tensor parallelism: shard every component that has a plan, say which stay whole and why.

A diffusers pipeline holds a transformer, one or two text encoders, a VAE and tokenizers/schedulers. The transformer
is sharded after `unfuse` with the registered family plans; a text encoder with transformers' own plan (or a
registered one, `rewrites/t5.py`); what has no plan (CLIP, tokenizers) stays whole on every rank. A VAE keeps its
weights whole and has its decode split across the ranks (`surgery.decode_parallel`: each rank decodes its share of
the tiles, one gather), or, where it has no tiled decode, decodes whole on every rank. The same walk, on the meta device under torch's fake process group, accounts each component's bytes per rank for
`surgery plan --pipeline`.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.device_mesh import init_device_mesh

from surgery.core.build import default_dtype, model_on_meta, resolve_config
from surgery.core.errors import SurgeryError
from surgery.core.optional import need
from surgery.core.registry import families, resolve_model
from surgery.core.rewrite import fuse, unfuse
from surgery.core.walk import find_modules
from surgery.parallel.decode import VERB as DECODE_VERB, decode_parallel
from surgery.parallel import quantized
from surgery.parallel.distributed import fake_process_group, one_dim_mesh
from surgery.parallel.plans import checked_plan, planned_modules
from surgery.parallel.tensor_parallel import tensor_parallel

logger = logging.getLogger("surgery")


def _bytes(model: nn.Module) -> dict:
    """Bytes of the whole component, held per rank, and the per-rank split between sharded and whole tensors."""
    total = sharded = replicated = 0
    for param in model.parameters():
        whole = param.numel() * param.element_size()
        total += whole
        if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):
            local = param.to_local()
            sharded += local.numel() * local.element_size()
        else:
            replicated += whole
    return {"bytes": total, "bytes_per_rank": sharded + replicated, "sharded_bytes_per_rank": sharded,
            "replicated_bytes_per_rank": replicated}


def _no_plan_reason(model: nn.Module) -> str:
    cls = type(model)
    library = cls.__module__.split(".")[0]
    shipped = " nor shipped by transformers" if library == "transformers" else ""
    return f"no tensor-parallel plan: none registered with surgery for {cls.__name__}{shipped}"


def plan_component(name: str, model: nn.Module, world: int, *, required: bool = False) -> dict:
    """Unfuse (where fused modules are registered) and check one component for a mesh of `world` ranks: its report
    row, with the reason it stays whole ("" where it shards). Nothing is sharded here.

    `required`: a component that cannot be sharded raises instead (the pipeline's transformer), fused back first.
    """

    row = {"component": name, "class": type(model).__name__, "unfused": bool(find_modules(model, fused=True))}
    if row["unfused"]:
        unfuse(model)
    try:
        reason = None
        if not planned_modules(model):
            reason = _no_plan_reason(model)
        else:
            adopted = quantized.adopt(model)  # as tensor_parallel does first: GGUF / fp8r Linears as nn.Linears
            try:
                checked_plan(model, None, None, world)  # the checks tensor_parallel makes, coverage included
            except BaseException as error:
                quantized.unadopt(adopted)
                if required or not isinstance(error, SurgeryError):
                    raise
                reason = f"cannot be sharded over {world}: {str(error).removeprefix('surgery.tensor_parallel: ')}"
        if reason is not None and required:
            raise SurgeryError(f"surgery.tensor_parallel_pipeline: the pipeline's {name} ({type(model).__name__}) "
                               f"has {reason}.")
    except BaseException:
        if row["unfused"]:
            fuse(model)
        raise
    return {**row, "reason": reason or ""}


def shard_component(name: str, model: nn.Module, mesh: DeviceMesh, *, src_data_rank: int | None,
                    required: bool = False) -> dict:
    """`plan_component`, then shard the component where it can be: its report row with its bytes per rank."""

    row = plan_component(name, model, mesh.size(), required=required)
    return _shard(row, model, mesh, src_data_rank)


def _shard(row: dict, model: nn.Module, mesh: DeviceMesh, src_data_rank: int | None) -> dict:
    if not row["reason"]:
        tensor_parallel(model, mesh, src_data_rank=src_data_rank)
    return {**row, "sharded": not row["reason"], **_bytes(model)}


def split_decode(name: str, vae: nn.Module, mesh: DeviceMesh) -> dict:
    """The VAE's decode split across the ranks (its weights whole on every rank); or, where it cannot be, the VAE
    left as it was, decoding whole on every rank, with the reason."""
    try:
        decode_parallel(vae, mesh)
        reason = f"weights whole; its decode split over {mesh.size()} ranks by tiles"
    except SurgeryError as error:
        reason = (f"decoded whole on every rank: "
                  f"{str(error).removeprefix(f'surgery.{DECODE_VERB}: ')}")
    return {"component": name, "class": type(vae).__name__, "sharded": False, "reason": reason, **_bytes(vae)}


def tensor_parallel_pipeline(pipe, mesh: DeviceMesh, *, src_data_rank: int | None = 0) -> list[dict]:
    """Shard every component of a diffusers pipeline that has a plan, in place; returns (and logs once, on rank 0)
    one row per component: sharded or whole, why, and its bytes per rank.

    The transformer (`pipe.transformer`) is unfused and sharded, and must be shardable (an error otherwise, as
    `surgery.tensor_parallel` raises). Text encoders are sharded with transformers' own plan or a registered one;
    one that the mesh cannot split (heads, sizes) or that has no plan (CLIP) stays whole, with the reason. A VAE
    (`vae`, `audio_vae`, ...) stays whole with its decode split over the ranks (`decode_parallel`), or decoding
    whole where it has no tiled decode, said in its row. Tokenizers, schedulers and processors stay whole. Call it on
    every rank, with identical pipelines.

    Every component is planned and checked before the first is sharded: a refused transformer leaves the whole
    pipeline as it was (components unfused for the check are fused back).
    """

    mesh = one_dim_mesh(mesh, "tensor_parallel_pipeline")
    planned = []  # (module or None, row), in the pipeline's order
    try:
        for name, component in pipe.components.items():
            if component is None:
                continue
            if not isinstance(component, nn.Module):
                planned.append((None, {"component": name, "class": type(component).__name__, "sharded": False,
                                       "reason": "not a torch module (no weights to shard)", "bytes": 0,
                                       "bytes_per_rank": 0, "sharded_bytes_per_rank": 0,
                                       "replicated_bytes_per_rank": 0}))
                continue
            if name == "vae" or name.endswith("_vae"):  # split after every check passed: it agrees across ranks
                planned.append((component, {"component": name, "decode": True}))
                continue
            planned.append((component, plan_component(name, component, mesh.size(), required=name == "transformer")))
    except BaseException:
        for component, row in reversed(planned):
            if row.get("unfused"):
                fuse(component)
        raise
    report = [row if component is None
              else split_decode(row["component"], component, mesh) if row.get("decode")
              else _shard(row, component, mesh, src_data_rank)
              for component, row in planned]
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("surgery.tensor_parallel_pipeline over %d ranks:\n%s", mesh.size(), report_text(report))
    return report


def report_text(report: list[dict]) -> str:
    lines = []
    for row in report:
        size = f"{row['bytes_per_rank'] / 2**30:.2f} GiB per rank of {row['bytes'] / 2**30:.2f} GiB"
        what = "sharded" if row["sharded"] else f"whole ({row['reason']})"
        lines.append(f"  {row['component']:<16} {row['class']:<36} {size:<32} {what}")
    return "\n".join(lines)


def pipeline_components(model_name: str) -> dict:
    """The recorded components of a published pipeline (`Family.pipelines`), by `--model` name: the entry under that
    name, else the one under its transformer's class name."""
    family, variant = resolve_model(model_name)
    key = family.model_name(variant)
    # the variant's own entry, else the one every variant of its transformer class shares
    transformer = family.model_class if isinstance(family.model_class, str) else family.model_class.__name__
    for wanted in (key, transformer.rpartition(".")[2]):
        for owner in families().values():
            if wanted in owner.pipelines:
                return dict(owner.pipelines[wanted])
    known = sorted(k for f in families().values() for k in f.pipelines)
    raise SurgeryError(f"no pipeline components are recorded for {key!r}; known: {', '.join(known)}.")


def build_on_meta(spec: tuple, dtype: torch.dtype) -> nn.Module:
    """A component `(class, config class or None, config)` built on the meta device in `dtype`."""

    cls_name, config_name, config = spec

    def load(qualified: str):
        module, _, name = qualified.rpartition(".")
        return getattr(need(module, f"building the pipeline component {name}"), name)

    cls = load(cls_name)
    with torch.device("meta"), default_dtype(dtype):
        if config_name is None:
            return cls(**config)
        return cls(load(config_name)(**config)).to(dtype)


def pipeline_plan(model_name: str, tp: int, *, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Every component of a published pipeline, built on meta from its recorded config and sharded (where it has a
    plan the mesh can split) under torch's fake process group: bytes per rank, sharded and replicated."""


    entry = pipeline_components(model_name)
    family, config = resolve_config(model_name)
    rows = []
    with fake_process_group(tp):
        mesh = init_device_mesh("cpu", (tp,))
        transformer = model_on_meta(family, config, dtype)
        rows.append(shard_component("transformer", transformer, mesh, src_data_rank=None, required=True))
        for name, spec in entry.items():
            if name == "pipeline":
                continue
            rows.append(shard_component(name, build_on_meta(spec, dtype), mesh, src_data_rank=None))
    return {
        "pipeline": entry["pipeline"],
        "model": model_name,
        "tp": tp,
        "dtype": str(dtype).removeprefix("torch."),
        "components": rows,
        "bytes": sum(r["bytes"] for r in rows),
        "bytes_per_rank": sum(r["bytes_per_rank"] for r in rows),
        "replicated_bytes_per_rank": sum(r["replicated_bytes_per_rank"] for r in rows),
    }


def pipeline_plan_text(result: dict) -> str:
    gib = 2**30
    lines = [f"{result['model']} ({result['pipeline']}), TP {result['tp']}, {result['dtype']}: every component's bytes "
             "per rank (sharded + replicated)", ""]
    header = f"  {'component':<16} {'class':<36} {'total':>10} {'per rank':>10} {'sharded':>10} {'replicated':>10}  "
    lines.append(header)
    for r in result["components"]:
        lines.append(f"  {r['component']:<16} {r['class']:<36} {r['bytes'] / gib:>8.2f}Gi "
                     f"{r['bytes_per_rank'] / gib:>8.2f}Gi {r['sharded_bytes_per_rank'] / gib:>8.2f}Gi "
                     f"{r['replicated_bytes_per_rank'] / gib:>8.2f}Gi  "
                     f"{'sharded' if r['sharded'] else 'whole: ' + r['reason']}")
    lines.append(f"  {'all':<16} {'':<36} {result['bytes'] / gib:>8.2f}Gi {result['bytes_per_rank'] / gib:>8.2f}Gi "
                 f"{'':>10} {result['replicated_bytes_per_rank'] / gib:>8.2f}Gi")
    return "\n".join(lines)
