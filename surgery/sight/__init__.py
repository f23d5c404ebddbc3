"""What a person reads: tables of what was rewritten and how each rank is laid out (`report`, rendered by `render`),
diagrams of a block's graphs (`trace` -> `graph` -> `forms`, drawn by `diagram` with `svg`'s geometry), and Google's
Model Explorer (`explore`).
"""

from surgery.sight import report, render, trace, graph, forms, svg, diagram, explore  # noqa: F401  (in layer order)
