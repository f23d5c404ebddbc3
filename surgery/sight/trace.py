"""A module's forward traced on meta into an FX graph, each call marked with the module that made it.

`trace(module, args, kwargs)` is the first step of a diagram (`surgery.sight.graph.reduce` the second). The nodes and
edges a diagram shows (`Node`, `Edge`, `BlockGraph`) are defined here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
import inspect as pyinspect


@dataclass
class Node:
    id: str
    kind: str  # input, projection, norm, attention, activation, join, collective, output
    label: str
    shape: str = ""
    module: str = ""  # path of the module it runs in, relative to the traced module
    parameter: str = ""  # projections and norms: their weight's name
    sharding: str = ""  # projections: colwise, rowwise, replicated, or fused (no stock plan: unfuse first)
    storage: str = ""  # projections: "view of W rows a:b", "copy of W columns a:b", "fused: ..."
    local: str = ""  # projections: the weight's shape on this rank ("out x in")
    bytes: int = 0  # parameter bytes this rank holds; collectives: bytes reduced
    held: str = ""  # sharded projections: what this rank holds ("heads 0-3, rows 0:512 of 4096")
    fx: list[str] = field(default_factory=list)  # the traced graph's nodes it stands for


@dataclass
class Edge:
    src: str
    dst: str
    shape: str
    partial: bool = False  # carries a partial sum (a rowwise projection's output before its all-reduce)


@dataclass
class BlockGraph:
    title: str
    nodes: list[Node]
    edges: list[Edge]
    traced: Any = field(default=None, repr=False)  # the torch.fx.GraphModule it was reduced from
    module: Any = field(default=None, repr=False)

    def count(self, kind: str) -> int:
        return sum(n.kind == kind for n in self.nodes)

    def by_label(self, label: str) -> Node:
        return next(n for n in self.nodes if n.label == label)


# --- tracing ---------------------------------------------------------------------------------------------------------

# Functions that decompose into many ops on some devices (attention runs as bmm/softmax on meta): every op they run is
# tagged with one call id through torch.fx's node-meta annotation, so the reduction draws the call as one node.
_MARKED = {F.scaled_dot_product_attention: "attention"}


class _MarkCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _MARKED.get(func)
        if kind is None:
            return func(*args, **kwargs)
        self.calls += 1
        with fx_traceback.annotate({"surgery_call": f"{kind}_{self.calls}", "surgery_kind": kind}):
            return func(*args, **kwargs)


def _input_name(path: tuple, positional: list[str] = ()) -> str:
    where, *rest = path
    if where == pytree.SequenceKey(0) and rest and isinstance(rest[0], pytree.SequenceKey) \
            and rest[0].idx < len(positional):  # a positional argument: its parameter's name
        where, rest = pytree.SequenceKey(1), [pytree.MappingKey(positional[rest[0].idx]), *rest[1:]]
    parts = []
    for key in rest:
        if isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.SequenceKey):
            parts.append(f"[{key.idx}]")
        else:
            parts.append(str(key))
    name = "".join(p if p.startswith("[") else (f".{p}" if i else p) for i, p in enumerate(parts))
    return f"arg{name}" if where == pytree.SequenceKey(0) else name


def _positional_names(module: nn.Module) -> list[str]:
    """The names of `module.forward`'s positional parameters, in order (`hidden_states`, `temb`, ...), so that the
    diagram's inputs carry the names the forward gives them, not `arg[0]`; extra positionals stay `arg[i]`."""

    try:
        parameters = pyinspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (pyinspect.Parameter.POSITIONAL_ONLY, pyinspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def trace(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> torch.fx.GraphModule:
    """One forward of `module` as an aten-level `torch.fx` graph, each node knowing the submodule it ran in.

    Uses `make_fx` rather than `torch.export` because it is the tracer that also runs DTensor-sharded modules (torch
    2.13's export cannot trace the parallel styles' input hooks), so fused, unfused and sharded forms are traced and
    reduced alike. Meta tensors work (nothing is allocated). Placeholders carry their argument's name in
    `meta["surgery_input"]`.
    """
    leaves, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs or {})))
    positional = _positional_names(module)
    values = [v for _, v in leaves]
    tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]

    def run(*inputs):
        filled = list(values)
        for i, t in zip(tensors, inputs):
            filled[i] = t
        a, k = pytree.tree_unflatten(filled, spec)
        with _MarkCalls():
            return module(*a, **k)

    run._orig_mod = module  # make_fx records `nn_module_stack` paths relative to this module
    # A global hook makes each packed leaf (`SplitRows`: one GEMM over the buffer its parts view) run its parts' own
    # forwards, so the graph shows one projection per unfused Linear, with its own sharding and storage.
    hook = nn.modules.module.register_module_forward_hook(lambda module, inputs, output: None)
    try:
        with fx_traceback.preserve_node_meta(), torch.no_grad():
            traced = make_fx(run, record_module_stack=True)(*(values[i] for i in tensors))
    finally:
        hook.remove()
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for node, i in zip(placeholders, tensors):
        node.meta["surgery_input"] = _input_name(leaves[i][0], positional)
    return traced


