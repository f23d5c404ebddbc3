"""What a model family imports: the whole extension surface, in one module.

A family module (the built-in ones live in `rewrites/`, installed as `surgery_rewrites`) describes one diffusers model
class as data: its published configs with their source, its rewrites (fused module -> unfused module, as leaves swapped
inside the stock class wherever possible) and its tensor-parallel plans, literal dicts of stock torch styles. It ends
with `FAMILY = Family(...)`; `register_family(FAMILY)` makes every verb, the CLI and the conformance suite know it.

    from surgery.extend import Family, rows, swap_rewrite

    GATE_UP = rows("linear_in", lambda ff: [("gate", ff.hidden), ("up", ff.hidden)])
    FAMILY = Family(name="mine", model_class=MyTransformer, variants={...}, sources="...",
                    rewrites=(swap_rewrite("mine.ff", MyFeedForward, leaves=(GATE_UP,)),),
                    tp_plans={MyFeedForward: {"linear_in.gate": ColwiseParallel(), ...}})
"""

from surgery.core import build
from surgery.core.checks import check_hooks, check_linear, mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.core.leaves import (
    Leaf, Processors, columns, recast, register_edits, rows, runs_twin, swap_rewrite, translate, twin,
)
from surgery.core.registry import (
    Family,
    Rewrite,
    families,
    family_of,
    register_family,
    register_refused,
    register_replicated,
    register_rotary,
)
from surgery.core.rewrite import fuse, unfuse
from surgery.core.slicing import Slice, column_slices, row_slices
from surgery.core.split_projection import SplitProjection, SplitRows
from surgery.parallel.derive import per_head_norm, processor_writes_in_place, qk_norms_per_head
from surgery.parallel.families import derived_family
from surgery.parallel.styles import SPLIT_PROJECTION_TP_PLAN, under

__all__ = [
    # describing a family
    "Family", "derived_family", "register_family", "families", "family_of", "build", "register_replicated",
    "register_refused", "register_rotary",
    # rewrites: a leaf swapped inside the stock class, or a class of its own
    "Rewrite", "swap_rewrite", "Leaf", "rows", "columns", "Processors", "twin", "runs_twin", "translate", "recast",
    "register_edits",
    "SplitRows", "SplitProjection", "Slice", "row_slices", "column_slices",
    # a rewrite converting a nested module along (the core verbs, without diffusers' bookkeeping)
    "unfuse", "fuse",
    # plans and checks
    "under", "per_head_norm", "processor_writes_in_place", "qk_norms_per_head", "SPLIT_PROJECTION_TP_PLAN", "check_hooks", "check_linear", "mesh_sizes_dividing",
    "SurgeryError",
]
