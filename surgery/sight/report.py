"""Inspection: what unfuse rewrote, how tensor parallelism lays each rank out, and graphs of a block.

Plain data in, plain data out (lists of dicts); `surgery.sight.render` turns them into text or HTML.
"""

from __future__ import annotations

import contextlib
import re
from fnmatch import fnmatchcase
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from surgery.core.build import default_dtype, model_on_meta, resolve_config, tuple_output  # noqa: F401  (plan builds on meta)
from surgery.core.errors import SurgeryError
from surgery.core.registry import Family, model_class, replicated_for, resolve_model
from surgery.core.rewrite import unfuse
from surgery.core.walk import find_modules
from surgery.parallel.context_parallel import context_parallel
from surgery.parallel.distributed import CollectiveCounter, fake_process_group
from surgery.parallel.padding import cost as padding_cost, head_paddings
from surgery.parallel.plans import block_path, check_plan, linear_placements, planned_for
from surgery.parallel.tensor_parallel import tensor_parallel


def rewrite_table(model: nn.Module) -> list[dict]:
    """One row per unfused parameter: the module, its class before -> after, and the fused rows/columns it takes.

    Works on a fused model (what `unfuse` would do), an unfused or a sharded one, and on the meta device.
    """
    rows = []
    for fused in (True, False):
        for path, module, rewrite in find_modules(model, fused=fused):
            for s in rewrite.slices(module):
                rows.append({
                    "module": path,
                    "from": rewrite.fused.__name__,
                    "to": rewrite.unfused.__name__,
                    "parameter": s.unfused,
                    "fused": s.fused,
                    "takes": f"{'rows' if s.dim == 0 else 'columns'} {s.start}:{s.stop}",
                    "copy": s.dim != 0,
                })
    return rows


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(model: nn.Module) -> int:
    """Parameter bytes this rank holds."""
    return sum(local(p).nbytes for p in model.parameters())


def _placement(param: torch.Tensor) -> str:
    if not isinstance(param, DTensor):
        return "whole"
    return ", ".join(f"Shard({p.dim})" if p.is_shard() else type(p).__name__ for p in param.placements)


def tp_layout(model: nn.Module) -> list[dict]:
    """One row per parameter of this rank: placement, global and local shape, bytes held here."""
    rows = []
    for name, param in model.named_parameters():
        part = local(param)
        rows.append({
            "parameter": name,
            "placement": _placement(param),
            "sharded": isinstance(param, DTensor) and any(p.is_shard() for p in param.placements),
            "global shape": tuple(param.shape),
            "local shape": tuple(part.shape),
            "bytes": part.numel() * part.element_size(),
        })
    return rows


def declared_whole(model: nn.Module) -> list[dict]:
    """What a family keeps whole on every rank on purpose, with its reason (`TensorParallel.replicated` /
    `register_replicated`: Linears, and modules no stock style shards, like Sana's conv feed-forward): one row per
    reason, with the module kinds it covers (block index as `*`) and the bytes each rank holds of them."""
    owners: dict[str, str] = {}  # parameter -> reason (a parameter matched twice is counted once)
    kinds: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        for pattern, reason in replicated_for(module).items():
            for key, child in module.named_modules():
                if key and fnmatchcase(key, pattern):
                    full = ".".join(p for p in (path, key) if p)
                    kind = block_kind(full)
                    if kind not in kinds.setdefault(reason, []):
                        kinds[reason].append(kind)
                    owners.update({f"{full}.{n}": reason for n, _ in child.named_parameters()})
    params = dict(model.named_parameters())
    return [{"modules": kinds[reason], "reason": reason,
             "bytes": sum(local(params[n]).nbytes for n, r in owners.items() if r == reason)} for reason in kinds]


def block_kind(path: str) -> str:
    """`single_transformer_blocks.7.attn.to_q.weight` -> `single_transformer_blocks.*.attn.to_q.weight`."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path, count=1)


def collapse_blocks(rows: list[dict], column: str, also: tuple[str, ...] = ()) -> list[dict]:
    """Rows with the block index in `column` collapsed to `*`: one row per kind (and `also` columns), with a count."""
    kinds: dict[tuple, dict] = {}
    for row in rows:
        key = (block_kind(row[column]), *(row[c] for c in also))
        if key not in kinds:
            kinds[key] = dict(row, **{column: key[0]}, count=0)
        kinds[key]["count"] += 1
    return list(kinds.values())


def summarize_layout(rows: list[dict]) -> list[dict]:
    """Layout rows with block indices collapsed: one row per parameter kind, with its count and bytes per block."""
    return collapse_blocks(rows, "parameter")


class _Recorder(CollectiveCounter):
    """A `CollectiveCounter` that also files each collective under the block running at the time."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.block: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.total
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.total != before:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            shape = tuple(first.shape) if first is not None else ()
            self.events.append({"kind": "collective", "op": func.__name__.split(".")[0], "block": self.block,
                                "shape": shape, "bytes": first.nbytes if first is not None else 0})
        return out


@contextlib.contextmanager
def _hooks(modules: dict[str, nn.Module], pre, post) -> Iterator[None]:
    handles = []
    for path, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda m, a, k, p=path: pre(p, m, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, o, p=path: post(p, m, o)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _shape(x: Any) -> tuple | None:
    if isinstance(x, (tuple, list)):
        x = x[0] if x else None
    if isinstance(x, DTensor):
        return tuple(x.to_local().shape)
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def collectives_by_block(model: nn.Module, **inputs) -> dict:
    """Run one forward (meta tensors work) and count collectives per forward, per block kind, and their bytes."""
    events: list[dict] = []
    blocks = {f"{name}.{i}": block for name, child in model.named_children() if isinstance(child, nn.ModuleList)
              for i, block in enumerate(child)}
    recorder = _Recorder(events)

    def enter(path, module, args, kwargs):
        recorder.block = path

    def leave(path, module, output):
        recorder.block = None

    with torch.no_grad(), _hooks(blocks, enter, leave), recorder:
        model(**inputs)
    per_kind: dict[str, set] = {}
    counts: dict[str, int] = {}
    for event in events:
        kind = block_kind(event["block"]) if event["block"] else "outside blocks"
        counts[kind] = counts.get(kind, 0) + 1
        per_kind.setdefault(kind, set()).add(event["block"])
    bytes_by_op: dict[str, int] = {}
    for event in events:
        bytes_by_op[event["op"]] = bytes_by_op.get(event["op"], 0) + event.get("bytes", 0)
    return {
        "total": recorder.total,
        "bytes": recorder.bytes,
        "ops": dict(recorder.counts),
        "bytes_by_op": bytes_by_op,
        "per_block": {kind: counts[kind] // max(len(per_kind[kind]), 1) for kind in counts},
    }


def module_trace(module: nn.Module, *args, **kwargs) -> list[dict]:
    """The calls of `module`'s leaf modules and the collectives between them, in order, with this rank's shapes.

    On a sharded module this is the per-rank local graph: which Linear sees which local width, where the all-reduce
    sits. Runs one forward (meta tensors work).
    """
    events: list[dict] = []
    leaves = {path: m for path, m in module.named_modules() if path and not list(m.children())}

    def enter(path, m, a, k):
        x = a[0] if a else next(iter(k.values()), None)
        events.append({"kind": "module", "path": path, "class": type(m).__name__, "in": _shape(x),
                       "weight": _shape(getattr(m, "weight", None)), "placement": _placement(m.weight)
                       if isinstance(getattr(m, "weight", None), torch.Tensor) else ""})

    def leave(path, m, output):
        for event in reversed(events):
            if event.get("path") == path and "out" not in event:
                event["out"] = _shape(output)
                event["partial"] = isinstance(output, DTensor) and any(p.is_partial() for p in output.placements)
                break

    with torch.no_grad(), _hooks(leaves, enter, leave), _Recorder(events):
        module(*args, **kwargs)
    return [
        e if e["kind"] == "module" else
        {"kind": "collective", "path": e["op"], "class": "", "in": e["shape"], "weight": None, "placement": "",
         "out": e["shape"], "partial": False}
        for e in events
    ]


# --- torch.export graphs: the structural ops only -----------------------------------------------------------------

_KEPT = {"linear", "rms_norm", "scaled_dot_product_attention", "silu", "cat", "split", "split_with_sizes", "chunk"}
_COMBINE = {"mul", "add", "slice"}
_PASS = {"getitem", "to", "unflatten", "flatten", "permute", "reshape", "view", "unsqueeze", "clone", "contiguous",
         "expand", "transpose", "_to_copy", "alias"}


def _op(node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def export_graph(module: nn.Module, args: tuple, kwargs: dict | None = None) -> list[dict]:
    """`torch.export` of `module`, reduced to its structure: projections, norms, attention, activations, joins.

    Each row: op, the parameter it uses (Linear and norm weights), the rows it reads from, output shape.
    """
    exported = torch.export.export(module, args, kwargs or {})
    params = exported.graph_signature.inputs_to_parameters
    source: dict[str, str | None] = {}  # node -> the kept node it carries (through casts, views, rope, ...)
    direct: dict[str, bool] = {}  # node -> reached from a kept node through views and casts only
    rows = []
    for node in exported.graph_module.graph.nodes:
        if node.op == "placeholder":
            source[node.name], direct[node.name] = None, False
            continue
        if node.op != "call_function":
            continue
        op = _op(node)
        inputs = [a for a in node.args if hasattr(a, "name")] + [
            x for a in node.args if isinstance(a, (list, tuple)) for x in a if hasattr(x, "name")]
        data = [a.name for a in inputs if a.name not in params]
        feeding = list(dict.fromkeys(source[n] for n in data if source.get(n)))
        if op in _KEPT or (op in _COMBINE and data and all(direct.get(n) for n in data)):
            label = f"{op}_{len(rows)}"
            value = node.meta.get("val")
            rows.append({
                "node": label,
                "op": op,
                "parameter": ", ".join(params[a.name] for a in inputs if a.name in params),
                "inputs": ", ".join(feeding) or "input",
                "shape": tuple(value.shape) if isinstance(value, torch.Tensor) else
                " + ".join(str(tuple(v.shape)) for v in value) if isinstance(value, (list, tuple)) else "",
            })
            source[node.name], direct[node.name] = label, True
        else:
            source[node.name] = feeding[0] if feeding else None
            direct[node.name] = op in _PASS and bool(data) and all(direct.get(n) for n in data)
    return rows


def heads_by_rank(heads: int, world: int) -> list[range]:
    """Which attention heads each rank owns under column sharding of q/k/v (contiguous blocks); with zero heads
    padded up to a multiple of `world`, the real ones each rank holds (the last ranks hold the zero ones)."""
    per = -(-heads // world)
    return [range(min(rank * per, heads), min((rank + 1) * per, heads)) for rank in range(world)]


# --- planning without the hardware ---------------------------------------------------------------------------------


def plan(model: str | dict, tp: int, *, family: Family | None = None, dtype: torch.dtype = torch.bfloat16,
         image_tokens: int = 4096, text_tokens: int = 512, batch: int = 1, cp: int = 1, dp: int = 1) -> dict:
    """The exact per-rank layout and memory of a model at tensor-parallel size `tp`, on one CPU, allocating nothing.

    `model` is a `--model` name (`"flux2-klein-9b"`, `"flux1-dev"`, ...) or a config dict of `family`'s model class.
    Builds the model on meta, unfuses and shards it under the fake process group, and runs one meta forward at
    `image_tokens` + `text_tokens` (1024x1024 is 4096 image tokens) to count the collectives and their bytes.
    `cp` > 1 adds diffusers' Ulysses context parallelism (`surgery.context_parallel`) over a "cp" dimension, `dp` > 1
    FSDP2 (`fully_shard` per block, then the root) over a "dp" dimension: a `(dp, cp, tp)` mesh.
    """
    if cp > 1 or dp > 1:
        family, config = resolve_config(model, family)
        return _plan_2d(family, config, tp, cp, dp, dtype=dtype, image_tokens=image_tokens, text_tokens=text_tokens,
                        batch=batch)


    family, config = resolve_config(model, family)
    with fake_process_group(tp):
        model = model_on_meta(family, config, dtype)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        unfuse(model)
        # heads the mesh does not divide: planned as `tensor_parallel(..., pad_heads=True)` shards them, with the cost
        found = head_paddings(model, planned_for(model), tp, lambda path: block_path(model, path)[0])
        padding = padding_cost(model, found, tp) if found else None
        tensor_parallel(model, init_device_mesh("cpu", (tp,)), src_data_rank=None, pad_heads=bool(found))
        layout = tp_layout(model)
        whole = declared_whole(model)
        try:
            inputs = family.example_inputs(config, batch=batch, image_tokens=image_tokens, text_tokens=text_tokens,
                                           dtype=dtype, device="meta")
            collectives = collectives_by_block(model, **inputs)
        # a forward reading values back on meta, needing a package diffusers imports only where present (Cosmos'
        # padding mask: torchvision, a NameError when missing), a kernel refusing meta tensors (flex attention: a
        # ValueError, AnyFlow-FAR), or published features reading inputs the family's example inputs (made for its
        # test config) do not carry (RFD4's `token_type`: a KeyError)
        except (SurgeryError, NotImplementedError, RuntimeError, NameError, ImportError, ValueError, KeyError) as error:
            collectives = _declared_collectives(family, config, error)
    sharded = [r for r in layout if r["sharded"]]
    heads = getattr(model.config, "num_attention_heads", None) if hasattr(model, "config") else None
    return {
        "family": family.name,
        "tp": tp,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(torch.Size(r["global shape"]).numel() for r in layout),
        "model_bytes": total,
        "bytes_per_rank": sum(r["bytes"] for r in layout),
        "replicated_bytes": sum(r["bytes"] for r in layout if not r["sharded"]),
        "sharded_bytes": sum(r["bytes"] * tp for r in sharded),
        "declared_whole": whole,
        "layout": layout,
        "collectives": collectives,
        "tokens": {"image": image_tokens, "text": text_tokens, "batch": batch},
        "heads": [(r.start, r.stop) for r in heads_by_rank(heads, tp)] if isinstance(heads, int) else None,
        "padding": padding,
    }


def _declared_collectives(family: Family, config: dict, error: Exception) -> dict:
    """What the family declares one forward all-reduces, where a meta forward cannot run to count it."""
    if family.tp.all_reduces is None:
        raise SurgeryError(f"{family.name}: one forward cannot run on the meta device ({error}), and the family "
                           "declares no all_reduces to plan with.") from None
    count = family.tp.all_reduces(config)
    reason = str(error).splitlines()[0][:120]
    return {"total": count, "bytes": None, "ops": {"all_reduce": count}, "per_block": {},
            "note": f"declared by the family, not counted: its forward cannot run on the meta device ({reason})"}


def _plan_2d(family: Family, config: dict, tp: int, cp: int, dp: int, *, dtype: torch.dtype, image_tokens: int,
             text_tokens: int, batch: int) -> dict:
    """`plan` on a `(dp, cp, tp)` mesh: TP over "tp", then Ulysses over "cp", then FSDP2 over "dp"."""


    for what, count in (("image", image_tokens), ("text", text_tokens)):
        if count % cp:
            raise SurgeryError(f"plan: {count} {what} tokens do not split over cp={cp}; use a multiple of {cp}.")
    with fake_process_group(dp * cp * tp):
        model = model_on_meta(family, config, dtype)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        unfuse(model)
        if tp > 1:
            tensor_parallel(model, mesh["tp"], src_data_rank=None)
        if cp > 1:
            context_parallel(model, mesh["cp"])
        inputs = family.example_inputs(config, batch=batch, image_tokens=image_tokens, text_tokens=text_tokens,
                                       dtype=dtype, device="meta")
        for key in ("img_ids", "txt_ids"):  # diffusers' _cp_plans split position ids with a batch dim (3-D)
            if isinstance(inputs.get(key), torch.Tensor) and inputs[key].dim() == 2:
                inputs[key] = inputs[key].unsqueeze(0)
        collectives = collectives_by_block(model, **inputs, **tuple_output(model))
        if dp > 1:
            units = [block for child in model.children() if isinstance(child, nn.ModuleList) for block in child]
            for block in units:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            _add_fsdp_all_gathers(collectives, model, units)
        layout = tp_layout(model)
    heads = config.get("num_attention_heads")
    return {
        "tp": tp, "cp": cp, "dp": dp,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(torch.Size(r["global shape"]).numel() for r in layout),
        "model_bytes": total,
        "bytes_per_rank": sum(r["bytes"] for r in layout),
        "replicated_bytes": sum(r["bytes"] for r in layout if not r["sharded"]),
        "sharded_bytes": sum(r["bytes"] * tp * dp for r in layout if r["sharded"]),
        "layout": layout,
        "collectives": collectives,
        "tokens": {"image": image_tokens, "text": text_tokens, "batch": batch,
                   "per_rank": (image_tokens + text_tokens) // cp},
        "heads": [(r.start, r.stop) for r in heads_by_rank(heads, tp)] if heads else None,
    }


def _add_fsdp_all_gathers(collectives: dict, model: nn.Module, units: list[nn.Module]) -> None:
    """FSDP2's forward collectives, on paper (its forward refuses meta parameters): one all-gather per sharded unit
    (each block, then the root's own parameters), each rank contributing its shard of the unit."""
    inner = {id(p) for unit in units for p in unit.parameters()}
    shards = [sum(local(p).nbytes for p in unit.parameters()) for unit in units]
    shards.append(sum(local(p).nbytes for p in model.parameters() if id(p) not in inner))
    gathers = [b for b in shards if b]
    ops, by_op = collectives["ops"], collectives["bytes_by_op"]
    ops["all_gather_into_tensor"] = ops.get("all_gather_into_tensor", 0) + len(gathers)
    by_op["all_gather_into_tensor"] = by_op.get("all_gather_into_tensor", 0) + sum(gathers)
    collectives["total"] += len(gathers)
    collectives["bytes"] += sum(gathers)
    collectives["fsdp_all_gathers"] = {"count": len(gathers), "bytes": sum(gathers)}




# Bytes a quantized block Linear weight of `rows x cols` (this rank's part) stores, by format: torchao int8 keeps an
# fp32 scale and an int8 zero point per row, torchao float8 an fp32 scale per row; GGUF Q4_K packs 256 columns in a
# 144-byte block (4.5 bits per weight), so a column cut must fall on a multiple of 256.
QUANT_FORMATS = {
    "int8": {"bytes": lambda rows, cols: rows * cols + 5 * rows, "block": 1, "what": "torchao int8, per-row scale"},
    "fp8": {"bytes": lambda rows, cols: rows * cols + 4 * rows, "block": 1, "what": "torchao float8, per-row scale"},
    "q4": {"bytes": lambda rows, cols: rows * (cols // 256) * 144, "block": 256, "what": "GGUF Q4_K, 256-wide blocks"},
}


def quantized_plan(model: str | dict, tps, quant: str, *, family: Family | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per-rank bytes of `model` with every Linear's weight quantized (`quant`, a `QUANT_FORMATS` key: what torchao's
    `quantize_(model, config)` does by default) and everything else in `dtype`, at each tensor-parallel size in `tps`;
    a size the plan cannot split (heads, widths) or whose column cut falls inside a quantization block gets the reason
    instead of a number. A whole (unsharded) weight whose columns are no multiple of the block stays in `dtype`, as
    GGUF converters keep such tensors.

    Builds the unfused model once on meta and reads each planned Linear's style (colwise cuts rows, rowwise cuts
    columns); allocates nothing and runs no forward.
    """

    if quant not in QUANT_FORMATS:
        raise SurgeryError(f"surgery plan: --quant {quant!r} is not one of {', '.join(QUANT_FORMATS)}.")
    fmt = QUANT_FORMATS[quant]
    family, config = resolve_config(model, family)
    model = unfuse(model_on_meta(family, config, dtype))
    planned = planned_for(model)
    cuts: dict[str, tuple[str, int]] = {}  # parameter name -> (kind, cut dim)
    for path, module, plan in planned:
        for key, style in plan.items():
            linear = module.get_submodule(key)
            placements = linear_placements(style, linear)
            if placements is None or not isinstance(linear, nn.Linear):
                continue
            prefix = ".".join(p for p in (path, key) if p)
            for name in ("weight", "bias"):
                if getattr(linear, name, None) is not None:
                    placement = placements[name][0]
                    cuts[f"{prefix}.{name}"] = (name, placement.dim if placement.is_shard() else -1)
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            cuts.setdefault(f"{path}.weight", ("weight", -1))
    element = torch.empty(0, dtype=dtype).element_size()
    params = dict(model.named_parameters())
    rows = []
    for tp in tps:
        try:
            check_plan(model, planned, tp)
        except SurgeryError as error:
            rows.append({"tp": tp, "bytes_per_rank": None, "refused": str(error).split(": ", 1)[-1]})
            continue
        total, refused = 0, None
        for name, param in params.items():
            kind, dim = cuts.get(name, (None, -1))
            shape = list(param.shape)
            if dim >= 0:
                shape[dim] //= tp
            if kind == "weight" and (dim == 1 or shape[1] % fmt["block"] == 0):
                r, c = shape
                if c % fmt["block"]:
                    refused = (f"'{name}': {c} columns per rank is not a multiple of {quant}'s {fmt['block']}-wide "
                               "blocks")
                    break
                total += fmt["bytes"](r, c)
            else:
                total += torch.Size(shape).numel() * element
        rows.append({"tp": tp, "bytes_per_rank": None if refused else total, "refused": refused})
    return {"family": family.name, "quant": quant, "format": fmt["what"], "dtype": str(dtype).removeprefix("torch."),
            "rows": rows}


def quantized_plan_text(name: str, result: dict) -> str:
    lines = [f"{name}: Linears {result['format']}, the rest {result['dtype']}; GiB per rank"]
    for row in result["rows"]:
        value = f"{row['bytes_per_rank'] / 2**30:8.2f}" if row["bytes_per_rank"] is not None else "       -"
        lines.append(f"  TP {row['tp']}: {value}" + (f"   refused: {row['refused']}" if row["refused"] else ""))
    return "\n".join(lines)
