"""SVG geometry: the size a document is displayed at, stacking documents, scaling them to a page's width."""

import re

NOTEBOOK_WIDTH_PX = 1000
README_WIDTH_PX = 880
SCALE_NOTE = "surgery.diagram scale="


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


