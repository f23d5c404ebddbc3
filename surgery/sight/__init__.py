"""What a person reads: tables of what was rewritten and how each rank is laid out (`report`, rendered by `render`),
diagrams of a block's graphs (`diagram`), and Google's Model Explorer (`explore`).
"""

from surgery.sight import report, render, diagram, explore  # noqa: F401  (in layer order)
