"""What a reader's page can show: the width of every picture a notebook or the README displays, measured from the
picture itself (an SVG's width/height attributes, pt -> 4/3 px, else its viewBox; a PNG's header), against the width
the page gives it: ~1,000 px for a notebook cell, ~880 px for a README on a repository page."""

from __future__ import annotations

import base64
import re
import struct
from pathlib import Path

from surgery.sight.svg import NOTEBOOK_WIDTH_PX, README_WIDTH_PX, svg_scale, svg_size_px

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCS_SVGS = sorted((ROOT / "docs").glob("*.svg"))
# A diagram scaled below this to fit draws its 10 pt labels under 8 pt (~11 px): too small to read.
MIN_SCALE = 0.8

__all__ = ["NOTEBOOK_WIDTH_PX", "README_WIDTH_PX", "MIN_SCALE", "pictures", "too_wide", "NOTEBOOKS", "DOCS_SVGS"]


def _png_width(data: bytes) -> float:
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    width, _ = struct.unpack(">II", data[16:24])
    return float(width)


def pictures(notebook) -> list[tuple[str, str, str]]:
    """(where, kind, data) of every picture in a notebook's outputs: SVG text, base64 PNG, SVGs inlined in HTML."""
    found = []
    for i, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            where = f"cell {i}"
            if "image/svg+xml" in data:
                svg = data["image/svg+xml"]
                found.append((where, "svg", "".join(svg) if isinstance(svg, list) else svg))
            if "image/png" in data:
                found.append((where, "png", data["image/png"]))
            html = data.get("text/html")
            if html:
                html = "".join(html) if isinstance(html, list) else html
                found += [(where, "svg", m) for m in re.findall(r"<svg\b.*?</svg>", html, re.S)]
    return found


def too_wide(kind: str, data: str, limit_px: float) -> str | None:
    """Why a picture does not fit `limit_px` (wider, or scaled down below `MIN_SCALE` to fit), or None."""
    if kind == "png":
        width = _png_width(base64.b64decode(data))
        return f"a {width:.0f} px wide PNG (the page gives {limit_px:.0f} px)" if width > limit_px else None
    width, _ = svg_size_px(data)
    if width > limit_px:
        return f"a {width:.0f} px wide SVG (the page gives {limit_px:.0f} px)"
    scale = svg_scale(data)
    if scale < MIN_SCALE:
        return f"an SVG scaled down to {scale:.2f} of its size to fit: its labels are too small to read"
    return None
