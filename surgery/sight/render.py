"""Rendering of inspection tables: aligned text for terminals, HTML for notebooks."""

from __future__ import annotations

import html
from typing import Sequence

from surgery.sight.report import summarize_layout


def _cell(value) -> str:
    if isinstance(value, tuple):
        return " x ".join(str(v) for v in value) if value else "scalar"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def text_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as an aligned plain-text table."""
    if not rows:
        return "(nothing)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def html_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as an HTML table (for `IPython.display.HTML`)."""
    if not rows:
        return "<p>(nothing)</p>"
    columns = list(columns or rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row.get(c, '')))}</td>" for c in columns) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def mb(n: int) -> str:
    """Bytes in binary units, said as such: MiB (2^20) below a GiB, GiB (2^30) above. Every size `surgery` prints
    uses these (decimal GB appear only where a tool's own option takes them, as `--max-shard-size 10GB`)."""
    if n < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


# The plan's placements in the diagrams' words (a Linear weight's Shard(0) splits its output rows: colwise).
_PLACEMENT_WORDS = {"whole": "replicated", "Replicate": "replicated", "Shard(0)": "colwise (rows)",
                    "Shard(1)": "rowwise (columns)"}
SMALL = 2**20  # replicated parameters smaller than this are summed into one row of `surgery plan`


def in_words(rows: Sequence[dict], key: str = "placement") -> list[dict]:
    """Rows with their DTensor placements (`Shard(0)`, `Shard(1)`, `Replicate`, `whole`) said in the diagrams' words:
    colwise (rows), rowwise (columns), replicated."""
    return [dict(r, **{key: _PLACEMENT_WORDS.get(r.get(key), r.get(key))}) if key in r else dict(r) for r in rows]


def layout_rows(layout: list[dict]) -> list[dict]:
    """`surgery plan`'s table: one row per parameter kind (blocks collapsed), placements in the diagrams' words,
    and the replicated parameters under 1 MiB each (biases, norms) summed into one row."""
    rows, small = [], []
    for r in summarize_layout(layout):
        # the words are a Linear's (2-D, out x in); another tensor's placement is said as DTensor says it (a MoE's
        # 3-D experts: Shard(1), Shard(2))
        said = len(r.get("global shape", ())) <= 2 or not str(r["placement"]).startswith("Shard")
        row = dict(r, placement=_PLACEMENT_WORDS.get(r["placement"], r["placement"]) if said else r["placement"])
        if row["placement"] == "replicated" and r["bytes"] < SMALL:
            small.append(row)
        else:
            rows.append(dict(row, **{"per rank": mb(r["bytes"] * r["count"])}))
    if small:
        count = sum(r["count"] for r in small)
        total = sum(r["bytes"] * r["count"] for r in small)
        rows.append({"parameter": f"(replicated, under {mb(SMALL)} each)", "count": count,
                     "placement": "replicated", "global shape": "", "local shape": "", "per rank": mb(total)})
    return rows


def plan_text(name: str, p: dict) -> str:
    """`surgery plan`'s report."""
    c = p["collectives"]
    tokens = p["tokens"]
    lines = [
        f"{name}, tensor parallel {p['tp']} ({p['dtype']}; planned on the meta device under torch's fake process "
        "group: nothing allocated)",
        f"parameters {p['parameters'] / 1e9:.2f} B = {mb(p['model_bytes'])}; per rank {mb(p['bytes_per_rank'])} = "
        f"{mb(p['replicated_bytes'])} replicated + {mb(p['sharded_bytes'])} sharded / {p['tp']}",
        "",
        text_table(layout_rows(p["layout"]),
                   ["parameter", "count", "placement", "global shape", "local shape", "per rank"]),
        "placement: colwise = output rows split over the ranks (ColwiseParallel), rowwise = input columns split\n"
        "(RowwiseParallel), replicated = whole on every rank; per rank: bytes of all `count` (MiB = 2^20, GiB = 2^30)",
        *(["", "whole on every rank on purpose:"] + [
            f"  {', '.join(w['modules'][:3])}{' ...' if len(w['modules']) > 3 else ''} ({mb(w['bytes'])} per rank): "
            f"{w['reason']}" for w in p.get("declared_whole", ())] if p.get("declared_whole") else []),
        "",
        f"collectives per forward (batch {tokens['batch']}, {tokens['image']} image + {tokens['text']} text tokens): "
        f"{c['total']} ({', '.join(f'{n} {op}' for op, n in c['ops'].items()) or 'none'})"
        + (f", {mb(c['bytes'])}" if c["bytes"] is not None else ""),
        "  per block: " + (", ".join(f"{kind} {n}" for kind, n in c["per_block"].items()) or "-"),
        *([f"  ({c['note']})"] if c.get("note") else []),
    ]
    padding = p.get("padding")
    if padding:
        heads = ", ".join(f"{a} -> {b}" for a, b in padding["heads"])
        lines += [
            f"  zero heads: {heads} on {padding['attentions']} attentions (the mesh does not divide the heads; "
            "tensor_parallel(..., pad_heads=True))",
            f"    cost per rank: {mb(padding['bytes_per_rank'])} of zero weights, "
            f"{padding['projection_flops_per_token_per_rank'] / 1e6:,.2f} MFLOP per token in projections, "
            f"{padding['attention_flops_per_token_per_key_per_rank']:,} FLOP per query-key pair in attention",
        ]
    if p["heads"]:
        line = "  heads per rank:"
        for r, (a, b) in enumerate(p["heads"]):
            item = (f" rank {r}: {a}-{b - 1}" if b > a else f" rank {r}: zero heads only") + (
                "," if r < len(p["heads"]) - 1 else "")
            if len(line) + len(item) > 100:
                lines.append(line)
                line = "   "
            line += item
        lines.append(line)
    return "\n".join(lines)
