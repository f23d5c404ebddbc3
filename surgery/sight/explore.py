"""Google's Model Explorer on a block's traced graphs, with node-data overlays from the tensor-parallel plan.

`explorer_files(graphs, out_dir)` writes what Model Explorer loads: one graph JSON (a graph per form: fused,
unfused, one rank's) built with Model Explorer's own `graph_builder`, and node-data JSON files built with its
`node_data_builder`: placement of each projection's weight, parameter bytes per rank, and the bytes each collective
all-reduces (one overlay each). `explore(model, inputs, tp=N)` writes them and starts Model Explorer's local server.
The package is an optional extra (`pip install ai-edge-model-explorer`, or `pip install -e ".[explore]"`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn as nn
from dataclasses import asdict

from surgery.core.errors import SurgeryError
from surgery.io.atomic import write_text
from surgery.sight.diagram import SHARDING_COLORS
from surgery.sight.forms import forms
from surgery.sight.trace import BlockGraph

INSTALL = "Model Explorer is an optional extra: pip install ai-edge-model-explorer (or pip install -e \".[explore]\")."
OVERLAYS = ("placement", "bytes per rank", "all-reduce bytes")
LOOKED_THROUGH = "rotary_casts_views"  # the layer that holds the ops the diagrams do not draw


def _model_explorer():
    try:
        import model_explorer  # lazy: optional extra
    except ImportError:
        raise SurgeryError(f"surgery.sight.explore: {INSTALL}") from None
    return model_explorer


def _graph_id(graph: BlockGraph) -> str:
    return graph.title


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    if isinstance(value, (list, tuple)):
        return ", ".join(_shape(v) for v in value if isinstance(v, torch.Tensor))
    return ""


def _anchors(graph: BlockGraph) -> dict[str, str]:
    """Traced node name -> the reduced node it belongs to (every member of a projection, norm, attention, ...)."""
    return {fx: node.id for node in graph.nodes for fx in node.fx}


def explorer_graph(graph: BlockGraph):
    """The full traced graph of `graph` as a Model Explorer `graph_builder.Graph`.

    Every aten op is a node (weights shown as attributes, not nodes), nested in layers named by the submodule it ran
    in (`mlp/linear_gate`), so Model Explorer folds the graph back into the module tree; attention calls form their
    own layer. Node ids are the traced graph's node names.
    """
    gb = _model_explorer().graph_builder
    members = _anchors(graph)
    reduced = {n.id: n for n in graph.nodes}
    out = gb.Graph(id=_graph_id(graph))
    included: set[str] = set()
    for fx_node in graph.traced.graph.nodes:
        if fx_node.op not in ("placeholder", "call_function", "output"):
            continue
        stack = list((fx_node.meta.get("nn_module_stack") or {}).values())
        path = stack[-1][0] if stack else ""
        namespace = path.replace(".", "/")
        custom = fx_node.meta.get("custom") or {}
        if "surgery_call" in custom:
            namespace = "/".join(p for p in (namespace, custom["surgery_call"]) if p)
        elif fx_node.op == "call_function" and fx_node.name not in members:
            # What the SVG looks through (rotary-embedding arithmetic, casts, views, modulation) folds into one
            # collapsed layer per module, so the projections, attention and collectives stay in view.
            namespace = "/".join(p for p in (namespace, LOOKED_THROUGH) if p)
        label = fx_node.meta.get("surgery_input", fx_node.name) if fx_node.op == "placeholder" else (
            "output" if fx_node.op == "output" else getattr(fx_node.target, "__name__", str(fx_node.target)))
        node = gb.GraphNode(id=fx_node.name, label=str(label).split(".")[0], namespace=namespace)
        value = fx_node.meta.get("val")
        if value is not None:
            attrs = [gb.KeyValue("shape", _shape(value))]
            if isinstance(value, torch.Tensor):
                attrs.append(gb.KeyValue("dtype", str(value.dtype).removeprefix("torch.")))
            node.outputsMetadata.append(gb.MetadataItem(id="0", attrs=attrs))
        node.attrs.append(gb.KeyValue("op", str(fx_node.target)))
        owner = reduced.get(members.get(fx_node.name, ""))
        if owner is not None:
            for key in ("parameter", "sharding", "storage", "local"):
                if getattr(owner, key):
                    node.attrs.append(gb.KeyValue(key, str(getattr(owner, key))))
        for i, arg in enumerate(a for a in fx_node.all_input_nodes if a.name in included):
            node.incomingEdges.append(gb.IncomingEdge(sourceNodeId=arg.name, targetNodeInputId=str(i)))
        out.nodes.append(node)
        included.add(fx_node.name)
    return out


def _output_node(graph: BlockGraph, node) -> str:
    """The traced node where a reduced node's value leaves it (its last member)."""
    return node.fx[-1]


def overlays(graphs: list[BlockGraph]) -> dict[str, Any]:
    """Overlay name -> `node_data_builder.ModelNodeData` keyed by graph id, then by traced node name.

    - placement: each projection's sharding (colwise / rowwise / replicated / fused / stock), on its output node,
      as a label (a category: Model Explorer counts labels in a layer instead of summing or averaging codes);
    - bytes per rank: each projection's and norm's parameter bytes on this rank, on its output node;
    - all-reduce bytes: each collective's bytes, on the collective's node.

    Bytes are summed in the aggregated stats (min, max, sum); the children table's "Sum %" column, which would show
    bytes as percentages, is hidden.
    """

    ndb = _model_explorer().node_data_builder
    colors = dict(SHARDING_COLORS)
    data: dict[str, dict] = {name: {} for name in OVERLAYS}
    for graph in graphs:
        placement, sizes, reduced = {}, {}, {}
        for node in graph.nodes:
            anchor = _output_node(graph, node) if node.fx else None
            if anchor is None:
                continue
            if node.kind == "projection":
                placement[anchor] = ndb.NodeDataResult(value=node.sharding, bgColor=colors[node.sharding])
            if node.kind in ("projection", "norm") and node.bytes:
                sizes[anchor] = ndb.NodeDataResult(value=node.bytes)
            if node.kind == "collective":
                reduced[anchor] = ndb.NodeDataResult(value=node.bytes, bgColor="#cc0000", textColor="#ffffff")
        gid = _graph_id(graph)
        data["placement"][gid] = ndb.GraphNodeData(
            results=placement, name="placement", hideInAggregatedStatsTable=True,
            showExpandedSummaryOnGroupNode=True, showLabelCountColumnsInChildrenStatsTable=True)
        data["bytes per rank"][gid] = ndb.GraphNodeData(
            results=sizes, name="parameter bytes per rank", hideInChildrenStatsTable=True, hideAggregatedStats=["avg"],
            gradient=[ndb.GradientItem(stop=0, bgColor="#ffffff"), ndb.GradientItem(stop=1, bgColor="#e69138")])
        data["all-reduce bytes"][gid] = ndb.GraphNodeData(
            results=reduced, name="bytes all-reduced per rank", hideInChildrenStatsTable=True,
            hideAggregatedStats=["avg"])
    return {name: ndb.ModelNodeData(graphsData=by_graph) for name, by_graph in data.items()}


def explorer_files(graphs: list[BlockGraph], out_dir: str | os.PathLike, name: str = "block") -> dict[str, Any]:
    """Write `<name>.json` (the graphs, in Model Explorer's graph JSON) and one node-data JSON per overlay into
    `out_dir`; returns {"graphs": path, "node_data": {overlay: path}}."""

    from model_explorer.utils import remove_none  # lazy: optional extra

    gb = _model_explorer().graph_builder
    os.makedirs(out_dir, exist_ok=True)
    collection = gb.GraphCollection(label=name, graphs=[explorer_graph(g) for g in graphs])
    graphs_path = os.path.join(os.fspath(out_dir), f"{name}.json")
    write_text(graphs_path, json.dumps(remove_none({"graphCollections": [asdict(collection)]})))
    paths = {}
    for overlay, data in overlays(graphs).items():
        path = os.path.join(os.fspath(out_dir), f"{name}.{overlay.replace(' ', '_')}.nodedata.json")
        write_text(path, data.to_json_string(indent=None))
        paths[overlay] = path
    return {"graphs": graphs_path, "node_data": paths}


def serve_files(files: dict[str, Any], host: str = "127.0.0.1", port: int = 8080, open_browser: bool = True) -> None:
    """Start Model Explorer's local server on the files `explorer_files` wrote (blocks until interrupted)."""
    model_explorer = _model_explorer()
    config = model_explorer.config()
    # The web app reads a local `.json` path as a TF.js model, so the graphs go in the way
    # `ModelExplorerConfig.add_model_from_pytorch` puts converted graphs: served from memory at `graphs://name/index`.
    with open(files["graphs"]) as f:
        config.graphs_list.append(f.read())
    name = os.path.basename(files["graphs"]).removesuffix(".json")
    config.model_sources.append({"url": f"graphs://{name}/{len(config.graphs_list) - 1}"})
    for path in files["node_data"].values():
        config.add_node_data_from_path(path)
    model_explorer.visualize_from_config(config, host=host, port=port, no_open_in_browser=not open_browser)


def explore(model: nn.Module, inputs: dict, module: str | None = None, tp: int | None = None,
            out_dir: str | os.PathLike = "model_explorer", serve: bool = True, host: str = "127.0.0.1",
            port: int = 8080) -> dict[str, Any]:
    """Open Model Explorer on `module` of `model` (fused, unfused and, with `tp`, rank 0's sharded graph) with the
    plan's overlays. `inputs` are `model`'s forward keyword arguments (see `surgery.sight.diagram.forms`; nothing is
    allocated, the model is untouched). With `serve=False` only the files are written; returns their paths."""
    _model_explorer()
    graphs = forms(model, inputs, module=module, tp=tp)
    files = explorer_files(graphs, out_dir)
    if serve:  # said before the server blocks
        print(f"wrote {files['graphs']} and {len(files['node_data'])} overlays; serving Model Explorer on "
              f"http://{host}:{port} (interrupt to stop)", flush=True)
        serve_files(files, host=host, port=port)
    return files
