"""Stock styles the families share, and how a module's plan composes into its parent's.

The core defines the leaves (`surgery.core.split_projection`); how they are sharded is tensor parallelism's business
and lives here, beside the rest of the plans (the core imports nothing from `surgery.parallel`).
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel

from surgery.core.split_projection import ATTN_PART, MLP_PART


def under(prefix: str, plan: dict) -> dict:
    """`plan` (keys relative to a module) with its keys relative to a parent that holds the module at `prefix`: how a
    block's literal plan composes a shared module's plan (`{**under("proj_out", SPLIT_PROJECTION_TP_PLAN)}`)."""
    return {".".join(p for p in (prefix, key) if p): style for key, style in plan.items()}


# A `SplitProjection`'s plan: both parts leave partial sums; the module's output resolves them with one all-reduce
# (before any gate or residual). Families compose it under the leaf's path (`under("proj_out", ...)`).
SPLIT_PROJECTION_TP_PLAN = {
    ATTN_PART: RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    MLP_PART: RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
}
