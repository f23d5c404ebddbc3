"""Stock styles the families share, how a module's plan composes into its parent's, and this library's two styles
beside torch's: `ShardParameters` (a module's own parameters, which no stock style places: 3-D expert weights) and
`ImplicitReplication` (a stock forward run on DTensors, `surgery.parallel.dtensor_attention`).

The core defines the leaves (`surgery.core.split_projection`); how they are sharded is tensor parallelism's business
and lives here, beside the rest of the plans (the core imports nothing from `surgery.parallel`).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleOutput, RowwiseParallel

from surgery.core.split_projection import ATTN_PART, MLP_PART
from surgery.parallel.dtensor_attention import ImplicitReplication

# The styles of this library a plan may name beside torch's stock ones (a printed plan star-imports them from here)
__all__ = ["ImplicitReplication", "ShardParameters"]


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


class ShardParameters(ParallelStyle):
    """A module's own parameters sharded as named, `{"gate_proj": Shard(2), "down_proj": Shard(1)}`, by
    `distribute_tensor` (each rank keeps its slice; `src_data_rank` as the stock styles take it); its inputs and
    outputs pass as they are (DTensors in, DTensors out). For parameters no stock style places: `ColwiseParallel` and
    `RowwiseParallel` take only `nn.Linear` and `nn.Embedding`, whose 2-D weights they shard on dim 0 or 1, while a
    MoE's routed experts hold 3-D `[experts, in, out]` tensors multiplied as `x @ w[e]` (columns: their last dim).
    A parameter already placed so (a sharded load) stays as it is."""

    def __init__(self, placements: dict[str, Placement]):
        super().__init__()
        self.placements = dict(placements)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is not module:
                return
            for key, placement in self.placements.items():
                param = getattr(mod, key)
                if isinstance(param, DTensor):
                    if tuple(param.placements) != (placement,):
                        raise ValueError(f"{key} is already a DTensor placed {param.placements}, not ({placement},)")
                    continue
                placed = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=self.src_data_rank)
                mod.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))

        return distribute_module(module, mesh, partition)

    def __repr__(self) -> str:
        return f"ShardParameters({self.placements})"
