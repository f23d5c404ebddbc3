"""What a model family imports: the extension surface, in one module.

A family module describes one diffusers model class as data: its published configs with their source, its rewrites
(fused module -> unfused module, as leaves swapped inside the stock class wherever possible), how it shards
(`TensorParallel`: literal plans of stock torch styles, Linears kept whole on purpose) and what the conformance suite
runs it on (`Tests`). Most families are `derived_family(...)`: their plans and all-reduce count are read off diffusers'
shared building blocks. `register_family(FAMILY)` makes every verb, the CLI and the conformance suite know it.

    from surgery.extend import Family, TensorParallel, Tests, rows, swap_rewrite

    GATE_UP = rows("linear_in", lambda ff: [("gate", ff.hidden), ("up", ff.hidden)])
    FAMILY = Family(name="mine", model_class=MyTransformer, variants={...}, sources="...",
                    rewrites=(swap_rewrite("mine.ff", MyFeedForward, leaves=(GATE_UP,)),),
                    tp=TensorParallel(plans={MyFeedForward: {"linear_in.gate": ColwiseParallel(), ...}}),
                    tests=Tests(configs={"tiny": {...}}))
    register_family(FAMILY)
"""

from surgery.core.leaves import Processors, columns, register_edits, rows, swap_rewrite
from surgery.core.registry import (
    Family, Rewrite, TensorParallel, Tests, families, register_family, register_replicated,
)
from surgery.core.slicing import Slice
from surgery.parallel.families import derived_family

__all__ = [
    # a family: the model, how it shards, what the conformance suite runs it on; registered and listed
    "Family", "TensorParallel", "Tests", "derived_family", "register_family", "families",
    # its rewrites: leaves swapped inside the stock class (rows, columns), processors run as head-dim twins (with the
    # edits the processor rule cannot read), or a class of its own with its slices
    "Rewrite", "swap_rewrite", "rows", "columns", "Processors", "register_edits", "Slice",
    # a Linear of the stock model kept whole on every rank on purpose, with its reason
    "register_replicated",
]
