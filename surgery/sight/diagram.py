"""Diagrams of a block's graph: fused, unfused, and one rank's sharded graph with its collectives.

`surgery.sight.forms.forms(model, inputs)` (trace, then reduce) traces one module of `model` (by default the fused module with the most slices) in each form
and reduces each trace to its structure: projections, norms, attention, activations, joins and collectives, with
the shapes that flow between them. Each projection carries how it is sharded (colwise / rowwise / replicated, from
the registered plan or, on a sharded module, from its DTensor placements) and whether its weight is a view or a copy
of the fused weight (from the rewrite's slices). `svg(graphs)` draws them side by side with Graphviz; without
Graphviz's `dot` program, `show` prints `text(graphs)` and says how to install it.

Nothing here names a model family: any registered family's module and example inputs work.
"""

from __future__ import annotations

import html
import os
import shutil

from surgery.core.errors import SurgeryError
from surgery.io.atomic import write_text
from surgery.sight.render import text_table
from surgery.sight.svg import NOTEBOOK_WIDTH_PX, stack_svgs
from surgery.sight.trace import BlockGraph, Node

HOW_TO_GET_DOT = (
    "Graphviz's `dot` program draws the diagrams: install it with `apt-get install graphviz` (Debian/Ubuntu), "
    "`brew install graphviz` (macOS) or `conda install graphviz`, and the Python package with "
    "`pip install graphviz`."
)


_LINE = 24  # characters per label line before it wraps

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

