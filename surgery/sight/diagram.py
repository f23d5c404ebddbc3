"""Diagrams of a block's graph: fused, unfused, and one rank's sharded graph with its collectives.

`forms(model, inputs)` traces one module of `model` (by default the fused module with the most slices) in each form
and reduces each trace to its structure: projections, norms, attention, activations, joins and collectives, with
the shapes that flow between them. Each projection carries how it is sharded (colwise / rowwise / replicated, from
the registered plan or, on a sharded module, from its DTensor placements) and whether its weight is a view or a copy
of the fused weight (from the rewrite's slices). `svg(graphs)` draws them side by side with Graphviz; without
Graphviz's `dot` program, `show` prints `text(graphs)` and says how to install it.

Nothing here names a model family: any registered family's module and example inputs work.
"""

from __future__ import annotations

import copy
import html
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.distributed.device_mesh import init_device_mesh
import inspect as pyinspect
import re

from surgery.core.errors import SurgeryError
from surgery.io.atomic import write_text
from surgery.core.rewrite import unfuse
from surgery.core.walk import find_modules
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.plans import planned_modules
from surgery.parallel.tensor_parallel import tensor_parallel
from surgery.sight.render import text_table

HOW_TO_GET_DOT = (
    "Graphviz's `dot` program draws the diagrams: install it with `apt-get install graphviz` (Debian/Ubuntu), "
    "`brew install graphviz` (macOS) or `conda install graphviz`, and the Python package with "
    "`pip install graphviz`."
)


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
    with fx_traceback.preserve_node_meta(), torch.no_grad():
        traced = make_fx(run, record_module_stack=True)(*(values[i] for i in tensors))
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for node, i in zip(placeholders, tensors):
        node.meta["surgery_input"] = _input_name(leaves[i][0], positional)
    return traced


# --- reduction to structure ------------------------------------------------------------------------------------------

_PASS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "clone",
         "contiguous", "_to_copy", "to", "detach", "alias", "getitem", "flatten", "unflatten", "wait_tensor",
         "lift_fresh_copy", "copy", "slice", "select", "alias_copy"}
_SPLITS = {"cat", "split", "split_with_sizes", "chunk"}
_COMBINE = {"mul", "add", "sub"}
_ACTIVATIONS = {"silu", "gelu", "relu", "sigmoid", "tanh", "softmax", "_softmax", "_safe_softmax"}
_NORMS = {"rms_norm", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "_fused_rms_norm"}
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "c10d"}


def _op(node: torch.fx.Node) -> tuple[str, str]:
    """(namespace, op name) of a call_function node: `aten.mm.default` -> ("aten", "mm")."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target._opname
    name = getattr(target, "__name__", str(target))
    return "", name


def _shape_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "×".join(str(d) for d in value.shape) or "scalar"
    if isinstance(value, (list, tuple)):
        return " + ".join(_shape_text(v) for v in value if isinstance(v, torch.Tensor))
    return ""


def _module_kind(module: nn.Module) -> str | None:
    """How a leaf module is drawn: projection, norm, activation; None to look at its ops one by one."""
    if list(module.children()):
        return None
    if isinstance(module, nn.Linear):
        return "projection"
    if "Norm" in type(module).__name__:
        return "norm"
    if type(module).__module__ == "torch.nn.modules.activation":
        return "activation"
    return None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _local_weight(module: nn.Module) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _sharding(module: nn.Module) -> dict[str, str]:
    """Linear path -> colwise / rowwise, from the registered plans of `module` and its submodules."""

    styles = {}
    for path, _, plan in planned_modules(module):
        for key, style in plan.items():
            if isinstance(style, ColwiseParallel):
                styles[_join(path, key)] = "colwise"
            elif isinstance(style, RowwiseParallel):
                styles[_join(path, key)] = "rowwise"
    return styles


def _placement_sharding(weight: torch.Tensor) -> str | None:
    if not isinstance(weight, DTensor):
        return None
    for placement in weight.placements:
        if placement.is_shard():
            return "colwise" if placement.dim == 0 else "rowwise"
    return "replicated"


def _slices(module: nn.Module) -> dict[str, str]:
    """Parameter name -> how it relates to the fused weight: 'view of W rows a:b', 'copy of W columns a:b', 'fused'."""
    notes: dict[str, str] = {}
    for path, sub, rewrite in find_modules(module, fused=True):
        parts: dict[str, list] = {}
        for s in rewrite.slices(sub):
            parts.setdefault(_join(path, s.fused), []).append(s)
        for name, slices in parts.items():
            views = sum(s.dim == 0 for s in slices)
            copies = len(slices) - views
            what = ", ".join(s.unfused.removesuffix(".weight") for s in slices)
            counts = " + ".join(x for x in (f"{views} row views" * bool(views), f"{copies} column copies" * bool(copies)) if x)
            notes[name] = f"fused: {what} ({counts})"
    for path, sub, rewrite in find_modules(module, fused=False):
        for s in rewrite.slices(sub):
            kind = "view of" if s.dim == 0 else "copy of"
            axis = "rows" if s.dim == 0 else "columns"
            notes[_join(path, s.unfused)] = f"{kind} {s.fused.removesuffix('.weight')} {axis} {s.start}:{s.stop}"
    return notes


def reduce(traced: torch.fx.GraphModule, module: nn.Module, title: str = "") -> BlockGraph:
    """A traced forward reduced to its structure.

    Leaf Linears, norms and activation modules become one node each (all the ops they ran), a marked call (attention)
    one node, collectives one node each; joins (`cat`, `split`, and `mul`/`add`/`slice` of computed branches) stay;
    slices (`chunk` halves), casts, views and arithmetic on side inputs (rotary embeddings, modulation) are looked
    through. Edges carry the shape of the tensor that crosses them.
    """
    reducer = _Reducer(module)
    for fx_node in traced.graph.nodes:
        reducer.add(fx_node)
    nodes, edges = reducer.pruned()
    _mark_partial(reducer.nodes, reducer.edges)
    return BlockGraph(title, nodes, edges, traced=traced, module=module)


class _Reducer:
    """The state of one `reduce`: the reduced nodes and edges so far, and which reduced node each fx node feeds."""

    def __init__(self, module: nn.Module):
        self.modules = dict(module.named_modules())
        # A module that still holds fused parts is the stock form: tensor_parallel refuses it until it is unfused, so
        # its stock projections are drawn as such (not as "replicated" beside a sharded neighbour).
        self.stock = bool(find_modules(module, fused=True))
        self.planned = {} if self.stock else _sharding(module)
        self.slice_notes = _slices(module)
        self.nodes: dict[str, Node] = {}
        self.edges: dict[tuple[str, str], Edge] = {}
        self.source: dict[str, str | None] = {}  # fx node -> the reduced node whose value it carries
        self.count = 0

    def new(self, kind: str, label: str, key: str | None = None) -> Node:
        self.count += 1
        node = Node(id=key or f"{kind}_{self.count}", kind=kind, label=label)
        self.nodes[node.id] = node
        return node

    def connect(self, node: Node, fx_inputs: list[torch.fx.Node]) -> None:
        for arg in fx_inputs:
            src = self.source.get(arg.name)
            if not src or src == node.id:
                continue
            shape = _shape_text(arg.meta.get("val"))
            edge = self.edges.get((src, node.id))
            if edge is None:
                self.edges[(src, node.id)] = Edge(src, node.id, shape)
            elif edge.shape != shape:  # parts of one value (a split tuple's elements): label the whole value
                edge.shape = self.nodes[src].shape or edge.shape

    def add(self, fx_node: torch.fx.Node) -> None:
        if fx_node.op == "placeholder":
            self.add_input(fx_node)
        elif fx_node.op == "output":
            self.add_output(fx_node)
        elif fx_node.op == "call_function":
            self.add_call(fx_node)

    def add_input(self, fx_node: torch.fx.Node) -> None:
        name = fx_node.meta.get("surgery_input", fx_node.name)
        node = self.new("input", name, key=f"input:{name}")
        node.shape = _shape_text(fx_node.meta.get("val"))
        node.fx.append(fx_node.name)
        self.source[fx_node.name] = node.id

    def add_output(self, fx_node: torch.fx.Node) -> None:
        node = self.new("output", "output", key="output")
        outputs = [a for a in pytree.tree_leaves(fx_node.args) if isinstance(a, torch.fx.Node)]
        self.connect(node, outputs)
        node.shape = " + ".join(_shape_text(a.meta.get("val")) for a in outputs if self.source.get(a.name))

    def add_call(self, fx_node: torch.fx.Node) -> None:
        """One op: a collective, part of a call or leaf module's node, a kept op, or looked through."""
        data = [a for a in pytree.tree_leaves((fx_node.args, fx_node.kwargs))
                if isinstance(a, torch.fx.Node) and a.op != "get_attr"]
        feeding = list(dict.fromkeys(self.source[a.name] for a in data if self.source.get(a.name)))
        node = self.node_for(fx_node, data, feeding)
        if node is None:  # looked through: carries the reduced node of its main input
            self.source[fx_node.name] = _main_source(fx_node, data, self.source, self.nodes)
            return
        self.connect(node, data)
        node.fx.append(fx_node.name)
        node.shape = _shape_text(fx_node.meta.get("val")) or node.shape
        self.source[fx_node.name] = node.id

    def node_for(self, fx_node: torch.fx.Node, data: list, feeding: list[str]) -> Node | None:
        """The reduced node an op belongs to (made on first sight), or None for an op that is looked through."""
        namespace, op = _op(fx_node)
        custom = fx_node.meta.get("custom") or {}
        stack = list((fx_node.meta.get("nn_module_stack") or {}).values())
        path = stack[-1][0] if stack else ""
        leaf = self.modules.get(path)
        leaf_kind = _module_kind(leaf) if leaf is not None and path else None
        group = custom.get("surgery_call") or (f"module:{path}" if leaf_kind else None)
        if group and op in _PASS and feeding and self.nodes[feeding[0]].kind == "collective":
            group = None  # the views after a collective in a Linear's output hook belong to the collective
        if namespace in _COLLECTIVE_NAMESPACES and op != "wait_tensor":  # also inside a Linear's output hook
            reduce_op = next((a for a in fx_node.args if isinstance(a, str)), "")
            node = self.new("collective", f"{op} ({reduce_op})" if reduce_op else op)
            node.module = path
            value = fx_node.meta.get("val")
            node.bytes = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
            return node
        if group:  # one node for all the ops of a call or of a leaf module
            node = self.nodes.get(group)
            if node is None:
                kind = custom.get("surgery_kind") or leaf_kind
                node = self.new(kind, path if leaf_kind else kind, key=group)
                node.module = path
                if leaf_kind:
                    _describe_module(node, leaf, path, self.planned, self.slice_notes, self.stock, self.modules)
            return node
        joins = op in _COMBINE and _joins(fx_node, data, feeding, self.nodes)
        if op in _ACTIVATIONS or op in _NORMS or op in _SPLITS or joins:
            node = self.new("activation" if op in _ACTIVATIONS else "norm" if op in _NORMS else "join", op)
            node.module = path
            return node
        return None

    def pruned(self) -> tuple[list[Node], list[Edge]]:
        """Dead ends (a modulation split whose parts are only looked through) go, then the inputs left unconnected."""
        while True:
            feeds = {e.src for e in self.edges.values()}
            dead = [n for n in self.nodes if self.nodes[n].kind not in ("input", "output") and n not in feeds]
            if not dead:
                break
            for n in dead:
                del self.nodes[n]
            self.edges = {k: e for k, e in self.edges.items() if e.dst in self.nodes}
        used = {e.src for e in self.edges.values()} | {e.dst for e in self.edges.values()}
        kept = [n for n in self.nodes.values() if n.kind not in ("input", "output") or n.id in used]
        return kept, list(self.edges.values())


def _mark_partial(nodes: dict, edges: dict) -> None:
    """Edges that carry partial sums: from a sharded rowwise projection (and on through the sums it joins) up to
    the collective that resolves them. Found from the graph, not from names: a rowwise projection followed by no
    collective of its own leaves a Partial, and a collective downstream resolves it."""
    out: dict[str, list[Edge]] = {}
    for e in edges.values():
        out.setdefault(e.src, []).append(e)
    frontier = [n.id for n in nodes.values() if n.kind == "projection" and n.sharding == "rowwise" and n.held]
    seen = set()
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        for e in out.get(current, []):
            target = nodes.get(e.dst)
            if target is None:
                continue
            if target.kind == "collective" or (target.kind == "join" and target.label in ("add", "sub")):
                e.partial = True
                if target.kind == "join":
                    frontier.append(target.id)


def _joins(fx_node: torch.fx.Node, data: list, feeding: list, nodes: dict) -> bool:
    """An elementwise op joins two computed branches (SwiGLU's product, a residual or output sum): at least two
    computed inputs, none broadcast. Scaling by side inputs (modulation, gates, rotary tables) is looked through."""
    value = fx_node.meta.get("val")
    if not isinstance(value, torch.Tensor) or sum(nodes[s].kind != "input" for s in feeding) < 2:
        return False
    return all(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].shape == value.shape for a in data)


def _main_source(fx_node: torch.fx.Node, data: list, source: dict, nodes: dict) -> str | None:
    """Which input an op that is looked through carries on: a computed value before a block input (the residual
    stream, not the skip), and one of the output's own shape before a broadcast side input (modulation, rotary)."""
    value = fx_node.meta.get("val")
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    candidates = [(source[a.name], a) for a in data if source.get(a.name)]
    if not candidates:
        return None

    def rank(candidate):
        src, arg = candidate
        arg_value = arg.meta.get("val")
        same = isinstance(arg_value, torch.Tensor) and tuple(arg_value.shape) == shape
        return (nodes[src].kind == "input", not same)

    return min(candidates, key=rank)[0]


def _describe_module(node: Node, leaf: nn.Module, path: str, planned: dict, slice_notes: dict, stock: bool = False,
                     modules: dict | None = None) -> None:
    weight = getattr(leaf, "weight", None)
    local = _local_weight(leaf)
    node.parameter = _join(path, "weight") if local is not None else ""
    node.bytes = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in leaf.parameters())
    if node.kind != "projection":
        return
    node.local = " × ".join(str(d) for d in local.shape) if local is not None else ""
    node.storage = slice_notes.get(node.parameter, "")
    node.sharding = (
        "fused" if node.storage.startswith("fused")
        else "stock" if stock
        else _placement_sharding(weight) or planned.get(path, "replicated")
    )
    if isinstance(weight, DTensor) and node.sharding in ("colwise", "rowwise"):
        head_dim, inner = _head_dim(path, modules or {})
        heads = head_dim if node.sharding == "colwise" and weight.shape[0] == inner else None
        node.held = _held(weight, local, heads)
        node.storage = _rank_storage(node.storage, weight, local)


def _shard_range(weight: DTensor, local: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(dim, start, stop, global size) of this rank's shard of `weight` (even shards, as the stock styles make)."""
    for mesh_dim, placement in enumerate(weight.placements):
        if placement.is_shard():
            dim = placement.dim % weight.ndim
            coordinate = weight.device_mesh.get_coordinate()
            index = coordinate[mesh_dim] if coordinate else 0
            size = local.shape[dim]
            return dim, index * size, (index + 1) * size, weight.shape[dim]
    return None


def _head_dim(path: str, modules: dict) -> tuple[int | None, int | None]:
    """(head size, heads x head size) of the attention a projection belongs to, from the nearest enclosing module
    that has `heads` (global: unfused modules keep the global sizes) and `head_dim` or `inner_dim`. A projection
    whose output is that wide is a q/k/v; others (an MLP's) are not split by heads."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner = modules.get(".".join(parts[:i]))
        heads = getattr(owner, "heads", None)
        if not isinstance(heads, int) or heads <= 0:
            continue
        head_dim, inner = getattr(owner, "head_dim", None), getattr(owner, "inner_dim", None)
        if isinstance(head_dim, int) and head_dim > 0:
            return head_dim, heads * head_dim
        if isinstance(inner, int) and inner % heads == 0:
            return inner // heads, inner
    return None, None


def _held(weight: DTensor, local: torch.Tensor, head_dim: int | None) -> str:
    """What this rank holds of a sharded projection: its rows (colwise) or columns (rowwise), and for the q/k/v of an
    attention its heads."""
    found = _shard_range(weight, local)
    if found is None:
        return ""
    dim, start, stop, size = found
    axis = "rows" if dim == 0 else "columns"
    text = f"{axis} {start}:{stop} of {size}"
    if head_dim and dim == 0 and start % head_dim == 0 and stop % head_dim == 0:
        first, last = start // head_dim, stop // head_dim - 1
        heads = f"head {first}" if first == last else f"heads {first}-{last}"
        text = f"{heads} of {size // head_dim}; {text}"
    return text


def _rank_storage(storage: str, weight: DTensor, local: torch.Tensor) -> str:
    """'view of W rows a:b' of the unsharded module, narrowed to the part this rank holds: 'from W rows a+s:a+t'."""

    match = re.fullmatch(r"(view|copy) of (\S+) (rows|columns) (\d+):(\d+)", storage)
    found = _shard_range(weight, local)
    if not match or found is None:
        return storage
    _, fused, axis, start, _ = match.groups()
    dim, lo, hi, _ = found
    if (axis == "rows") != (dim == 0):  # sliced along one dim, sharded along the other: the whole slice's range
        return f"from {fused} {axis} {start}:{match.group(5)}"
    return f"from {fused} {axis} {int(start) + lo}:{int(start) + hi}"


def block_graph(module: nn.Module, args: tuple = (), kwargs: dict | None = None, title: str = "") -> BlockGraph:
    """`reduce(trace(module, args, kwargs))`: one module's structural graph."""
    return reduce(trace(module, args, kwargs), module, title)


# --- the three forms of one module of a model ------------------------------------------------------------------------


def default_module(model: nn.Module) -> str:
    """The module a diagram shows by default: the fused (or unfused) module with the most slices, else the first
    module with a tensor-parallel plan."""

    found = find_modules(model, fused=True) or find_modules(model, fused=False)
    if found:
        return max(found, key=lambda f: len(f[2].slices(f[1])))[0]
    planned = planned_modules(model)
    if planned:
        return planned[0][0]
    raise SurgeryError(
        f"surgery.sight.diagram: '{type(model).__name__}' has no module that unfuse rewrites or tensor_parallel shards; "
        "pass module='path.to.module' to draw another one."
    )


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with every parameter and buffer on the meta device (the original is not touched)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise SurgeryError("surgery.sight.diagram: the model is already sharded (DTensor parameters); pass the unsharded "
                           "model, and tp=N to draw one rank's graph.")
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class _Captured(Exception):
    pass


def capture(model: nn.Module, path: str, inputs: dict) -> tuple[tuple, dict]:
    """The (args, kwargs) that `model(**inputs)` passes to its submodule `path` (the first call; the forward stops
    there)."""
    try:
        target = model.get_submodule(path)
    except AttributeError:
        raise SurgeryError(f"surgery.sight.diagram: '{type(model).__name__}' has no submodule '{path}'.") from None
    seen: dict = {}

    def hook(module, args, kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise _Captured

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise SurgeryError(f"surgery.sight.diagram: '{path}' never ran in one forward of '{type(model).__name__}'.")
    return seen["args"], seen["kwargs"]


def _to_meta(inputs: dict) -> dict:
    return pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, inputs)


def forms(model: nn.Module, inputs: dict, module: str | None = None, tp: int | None = None, rank: int = 0
          ) -> list[BlockGraph]:
    """The graphs of `module` (a path in `model`; default `default_module`): fused (if it is fused), unfused, and
    with `tp`, rank `rank`'s local graph under tensor parallelism with its collectives.

    `inputs` are `model`'s forward keyword arguments; the module's own inputs are captured from one forward. All of it
    runs on a meta copy of `model` (nothing allocated, the model untouched); the sharded form is planned under
    torch's fake process group, as `surgery plan` does, so any `tp` fits one CPU.
    """

    base = meta_copy(model)
    inputs = _to_meta(inputs)
    path = module if module is not None else default_module(base)
    if path not in dict(base.named_modules()):
        raise SurgeryError(f"surgery.sight.diagram: '{type(model).__name__}' has no submodule '{path}'.")
    graphs = []

    def draw(model_form: nn.Module, title: str) -> BlockGraph:
        args, kwargs = capture(model_form, path, inputs)
        return block_graph(model_form.get_submodule(path), args, kwargs, title=title)

    if find_modules(base.get_submodule(path), fused=True):
        graphs.append(draw(base, f"fused {path}"))
    unfuse(base)
    graphs.append(draw(base, f"unfused {path}"))
    if tp:
        with fake_process_group(tp, rank):
            sharded = meta_copy(base)
            tensor_parallel(sharded, init_device_mesh("cpu", (tp,)), src_data_rank=None)
            graphs.append(draw(sharded, f"rank {rank} of {tp} (tensor parallel)"))
    return graphs


# --- rendering -------------------------------------------------------------------------------------------------------

SHARDING_COLORS = {"colwise": "#9fc5e8", "rowwise": "#f9cb9c", "replicated": "#d9d9d9", "fused": "#d5a6bd",
                   "stock": "#ffffff"}
SHARDING_MEANING = {
    "colwise": "colwise: output rows split",
    "rowwise": "rowwise: input columns split",
    "replicated": "replicated: whole on every rank",
    "fused": "fused: unfuse before sharding",
    "stock": "stock layer (not sharded before unfuse)",
}
PARTIAL_COLOR = "#cc0000"
_KIND_STYLE = {
    "input": dict(shape="box", style="rounded,dashed", color="#666666", fontcolor="#333333"),
    "output": dict(shape="box", style="rounded,dashed", color="#666666", fontcolor="#333333"),
    "projection": dict(shape="box", style="filled"),
    "norm": dict(shape="box", style="rounded,filled", fillcolor="#ffffff", color="#6aa84f"),
    "attention": dict(shape="hexagon", style="filled", fillcolor="#b6d7a8"),
    "activation": dict(shape="ellipse", style="filled", fillcolor="#fff2cc"),
    "join": dict(shape="ellipse", style="filled", fillcolor="#ffffff"),
    "collective": dict(shape="octagon", style="filled,bold", fillcolor="#cc0000", fontcolor="#ffffff"),
}
_JOIN_SYMBOL = {"add": "+", "mul": "×", "sub": "−"}
# Widths a page gives a picture, in CSS px (1 pt = 4/3 px): a notebook cell, and a repository page's README.
NOTEBOOK_WIDTH_PX = 1000
README_WIDTH_PX = 880
_LINE = 24  # characters per label line before it wraps
SCALE_NOTE = "surgery.diagram scale="


def dot_available() -> bool:
    """True when the `graphviz` Python package and Graphviz's `dot` program are both installed."""
    try:
        import graphviz  # noqa: F401, lazy: Graphviz is optional (diagrams fall back to text)
    except ImportError:
        return False
    return shutil.which("dot") is not None


def _wrap(text: str, width: int = _LINE) -> list[str]:
    """Break a label line at spaces (and at "; ") so that no box grows wider than about `width` characters."""
    lines = []
    for part in text.split("; "):
        current = ""
        for word in part.split(" "):
            if current and len(current) + 1 + len(word) > width:
                lines.append(current)
                current = word
            else:
                current = f"{current} {word}" if current else word
        if current:
            lines.append(current)
    return lines or [text]


def _lines(*texts: str, italic: bool = False) -> list[str]:
    out = []
    for t in texts:
        for line in _wrap(t):
            out.append(f"<i>{html.escape(line)}</i>" if italic else html.escape(line))
    return out


def _label(node: Node) -> str:
    """An HTML-like Graphviz label: name in bold, then what the node is, wrapped to a narrow box."""
    lines = [f"<b>{line}</b>" for line in _lines(node.label)]
    if node.kind == "projection":
        lines += _lines(f"{node.sharding} · {node.local}")
        if node.held:
            lines += _lines(node.held)
        if node.storage:
            lines += _lines(node.storage.replace(" rows ", "; rows ").replace(" columns ", "; columns "),
                            italic=True)
    elif node.kind == "collective":
        lines += _lines(node.shape, f"{node.bytes / 2**20:,.1f} MiB per rank")
    elif node.kind == "join":
        lines = [f"<b>{html.escape(_JOIN_SYMBOL.get(node.label, node.label))}</b>"]
    elif node.kind in ("input", "output"):
        lines += _lines(node.shape)
    return "<" + "<br/>".join(lines) + ">"


def _dot_id(graph: int, node: str) -> str:
    return f"g{graph}_" + "".join(ch if ch.isalnum() else "_" for ch in node)


def _digraph(title: str = ""):
    import graphviz  # lazy: Graphviz is optional

    return graphviz.Digraph(graph_attr=dict(rankdir="TB", newrank="true", nodesep="0.18", ranksep="0.3",
                                            fontname="Helvetica", fontsize="14", label=title, labelloc="t",
                                            pad="0.05"),
                            node_attr=dict(fontname="Helvetica", fontsize="10", margin="0.06,0.03"),
                            edge_attr=dict(fontname="Helvetica", fontsize="9", color="#555555", fontcolor="#555555",
                                           arrowsize="0.6"))


def panel_dot(graph: BlockGraph, i: int = 0, title: str = ""):
    """One graph as a `graphviz.Digraph`: nodes by kind, projections coloured by what they are in this graph, edges
    labelled with shapes, partial sums red and dashed."""
    dot = _digraph(title)
    with dot.subgraph(name=f"cluster_{i}") as c:
        kind = f"<br/><font point-size=\"10\">{html.escape(type(graph.module).__name__)}</font>" if graph.module is not None else ""
        c.attr(label=f"<<b>{html.escape(graph.title)}</b>{kind}>", style="rounded", color="#999999", fontsize="13")
        for node in graph.nodes:
            attrs = dict(_KIND_STYLE[node.kind])
            if node.kind == "projection":
                attrs["fillcolor"] = SHARDING_COLORS.get(node.sharding, "#ffffff")
                if node.storage.startswith("copy"):
                    attrs["style"] = "filled,dashed"
                    attrs["penwidth"] = "2"
                elif node.storage.startswith("fused"):
                    attrs["penwidth"] = "2"
            if node.kind == "join":
                attrs.update(width="0.3", height="0.3", margin="0.02")
            c.node(_dot_id(i, node.id), _label(node), **attrs)
        # Fan-outs into several projections (q, k, v, gate, up from one input) would put every box side by side:
        # every second one goes one row lower, so that a block stays within a page's width.
        kinds = {n.id: n.kind for n in graph.nodes}
        lower, seen = set(), {}
        for edge in graph.edges:
            if kinds.get(edge.dst) == "projection":
                seen[edge.src] = seen.get(edge.src, 0) + 1
                if seen[edge.src] % 2 == 0:
                    lower.add((edge.src, edge.dst))
        side_by_side = sum(n for n in seen.values() if n >= 3)  # boxes that would share one row
        lower = {(src, dst) for src, dst in lower if seen[src] >= 3} if side_by_side >= 5 else set()
        for edge in graph.edges:
            attrs = {"minlen": "2"} if (edge.src, edge.dst) in lower else {}
            label = edge.shape
            if edge.partial:
                attrs.update(color=PARTIAL_COLOR, fontcolor=PARTIAL_COLOR, style="dashed", penwidth="1.6")
                label = f"{edge.shape} partial"
            c.edge(_dot_id(i, edge.src), _dot_id(i, edge.dst), label=f" {label}", **attrs)
    return dot


def legend_dot(graphs: list[BlockGraph] | None = None):
    """The legend: what every colour, border, shape and edge style means (rows of at most four entries)."""
    dot = _digraph()
    dot.attr(ranksep="0.12", nodesep="0.15")
    used = {n.sharding for g in graphs or [] for n in g.nodes if n.kind == "projection"}
    colours = [k for k in SHARDING_COLORS if not graphs or k in used]
    box = dict(shape="box", style="filled")
    entries = [(f"legend_{k}", SHARDING_MEANING[k], dict(box, fillcolor=SHARDING_COLORS[k])) for k in colours]
    entries += [
        ("legend_view", "view of the fused weight: solid border", dict(shape="box")),
        ("legend_copy", "copy of fused columns: dashed border", dict(shape="box", style="dashed", penwidth="2")),
        ("legend_norm", "norm", _KIND_STYLE["norm"]),
        ("legend_io", "block input / output", _KIND_STYLE["input"]),
        ("legend_attention", "attention", _KIND_STYLE["attention"]),
        ("legend_activation", "activation", _KIND_STYLE["activation"]),
        ("legend_join", "+ sum, × product, cat / split", _KIND_STYLE["join"]),
        ("legend_collective", "collective: bytes per rank", _KIND_STYLE["collective"]),
        ("legend_partial", "partial sum (red dashed edge) until the collective", dict(shape="plaintext",
                                                                                       fontcolor=PARTIAL_COLOR)),
    ]
    rows = [entries[i:i + 4] for i in range(0, len(entries), 4)]
    with dot.subgraph(name="cluster_legend") as legend:
        legend.attr(label="<<b>legend</b>>", style="rounded", color="#bbbbbb", fontsize="11")
        for row in rows:
            with legend.subgraph() as r:
                r.attr(rank="same")
                names = []
                for name, text, attrs in row:
                    if name == "legend_partial":  # a red dashed arrow before its text
                        r.node("legend_p0", "", shape="point", width="0.02", color=PARTIAL_COLOR)
                        names.append("legend_p0")
                    r.node(name, "<" + "<br/>".join(_lines(text)) + ">", **dict(attrs, fontsize="9"))
                    names.append(name)
                for a, b in zip(names, names[1:]):
                    if b == "legend_partial":
                        r.edge(a, b, color=PARTIAL_COLOR, style="dashed", penwidth="1.6", minlen="2")
                    else:
                        r.edge(a, b, style="invis")
        firsts = [row[0][0] for row in rows]
        for a, b in zip(firsts, firsts[1:]):
            legend.edge(a, b, style="invis")
    return dot


def _pipe_svg(dot) -> str:
    return dot.pipe(format="svg").decode()


def svg_size_px(text: str) -> tuple[float, float]:
    """(width, height) an SVG is displayed at, in CSS px: its `width`/`height` attributes (pt -> 4/3 px), else its
    viewBox."""

    head = re.search(r"<svg\b[^>]*>", text, re.S)
    if head is None:
        raise ValueError("not an SVG document")
    tag = head.group(0)
    units = {"pt": 4 / 3, "px": 1.0, "": 1.0, "in": 96.0, "cm": 96 / 2.54, "mm": 96 / 25.4, "pc": 16.0}

    def length(name):
        m = re.search(rf'\b{name}="([\d.]+)\s*(pt|px|in|cm|mm|pc|)"', tag)
        return float(m.group(1)) * units[m.group(2)] if m else None

    width, height = length("width"), length("height")
    if width is None or height is None:
        box = re.search(r'viewBox="[\d.\-]+[ ,]+[\d.\-]+[ ,]+([\d.]+)[ ,]+([\d.]+)"', tag)
        if box is None:
            raise ValueError("an SVG without width/height or viewBox")
        width, height = width or float(box.group(1)), height or float(box.group(2))
    return width, height


def stack_svgs(parts: list[str], max_width_px: float | None = None, gap_px: float = 8) -> str:
    """SVG documents stacked top to bottom in one SVG (each kept whole as a nested `<svg>`), scaled down as a whole
    when wider than `max_width_px`."""

    sizes = [svg_size_px(p) for p in parts]
    width = max(w for w, _ in sizes)
    height = sum(h for _, h in sizes) + gap_px * (len(parts) - 1)
    body, y = [], 0.0
    for i, (part, (w, h)) in enumerate(zip(parts, sizes)):
        inner = part[part.index("<svg"):]
        inner = re.sub(r"<svg\b", f'<svg x="{(width - w) / 2:.1f}" y="{y:.1f}"', inner, count=1)
        inner = re.sub(r'\b(width|height)="[\d.]+pt"', lambda m: f'{m.group(1)}="'
                       + (f"{w:.1f}" if m.group(1) == "width" else f"{h:.1f}") + '"', inner, count=2)
        inner = re.sub(r'id="([^"]+)"', rf'id="p{i}_\1"', inner)
        body.append(inner)
        y += h + gap_px
    scale = min(1.0, max_width_px / width) if max_width_px else 1.0
    return (f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
            f'width="{width * scale:.0f}px" height="{height * scale:.0f}px" viewBox="0 0 {width:.1f} {height:.1f}">\n'
            f"<!-- {SCALE_NOTE}{scale:.3f} -->\n" + "\n".join(body) + "\n</svg>\n")


def svg_scale(text: str) -> float:
    """The factor `stack_svgs` scaled a diagram down by to fit its page (1.0: drawn at natural size, 10 pt labels)."""

    found = re.search(re.escape(SCALE_NOTE) + r"([\d.]+)", text)
    return float(found.group(1)) if found else 1.0


def svg(graphs: list[BlockGraph], title: str = "", max_width_px: float | None = NOTEBOOK_WIDTH_PX,
        legend: bool = True) -> str:
    """The diagram as SVG text (needs `dot`; see `dot_available`): the graphs stacked top to bottom, then the
    legend, scaled down only if still wider than `max_width_px` (a notebook cell's width by default; pass
    `README_WIDTH_PX` for a repository page, None for natural size)."""
    if not dot_available():
        raise SurgeryError(f"surgery.sight.diagram: cannot draw without Graphviz. {HOW_TO_GET_DOT}")
    parts = [_pipe_svg(panel_dot(g, i, title if i == 0 else "")) for i, g in enumerate(graphs)]
    if legend:
        parts.append(_pipe_svg(legend_dot(graphs)))
    return stack_svgs(parts, max_width_px)


def write_svg(graphs: list[BlockGraph], path: str | os.PathLike, title: str = "",
              max_width_px: float | None = NOTEBOOK_WIDTH_PX) -> str:
    """Write the SVG atomically (a temporary sibling, then rename); returns the path."""
    return write_text(path, svg(graphs, title, max_width_px))


def rows(graph: BlockGraph) -> list[dict]:
    """One row per node: the text form of a diagram."""
    inputs: dict[str, list[str]] = {}
    for e in graph.edges:
        inputs.setdefault(e.dst, []).append(e.src)
    return [{"node": n.id, "kind": n.kind, "label": n.label, "shape": n.shape, "sharding": n.sharding,
             "storage": n.storage, "held": n.held, "inputs": ", ".join(inputs.get(n.id, []))} for n in graph.nodes]


def text(graphs: list[BlockGraph]) -> str:
    """The diagrams as text tables (what `show` prints without Graphviz)."""

    return "\n\n".join(f"{g.title}:\n{text_table(rows(g))}" for g in graphs)


def show(graphs: list[BlockGraph], title: str = "") -> None:
    """Display the diagram in a notebook; without Graphviz say how to get it and print the text tables instead."""
    if dot_available():
        try:
            from IPython.display import SVG, display  # lazy: in notebooks only

            display(SVG(svg(graphs, title)))
            return
        except Exception as error:  # a broken Graphviz install must not fail a notebook
            print(f"(could not draw the diagram: {error})")
    else:
        print(f"(no diagram: {HOW_TO_GET_DOT})")
    print(text(graphs))


def summary(graphs: list[BlockGraph]) -> list[dict]:
    """Node counts per graph and kind."""
    kinds = ["projection", "norm", "attention", "activation", "join", "collective"]
    return [{"graph": g.title, "nodes": len(g.nodes), **{k: g.count(k) for k in kinds}} for g in graphs]


def iter_projections(graphs: list[BlockGraph]) -> Iterator[tuple[str, Node]]:
    for g in graphs:
        for n in g.nodes:
            if n.kind == "projection":
                yield g.title, n
