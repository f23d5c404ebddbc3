"""A traced forward reduced to its structure: projections, norms, attention, activations, joins and collectives, with
the shapes between them; each projection carries how it is sharded and whether its weight is a view or a copy of the
fused weight. Nothing here names a model family.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
import re

from surgery.core.walk import find_modules
from surgery.parallel.plans import planned_modules
from surgery.sight.trace import BlockGraph, Edge, Node, trace

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


