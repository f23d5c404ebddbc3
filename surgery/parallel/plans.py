"""Tensor-parallel plans: which modules a plan covers in a model, and the styles the family files' plans share."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import SequenceParallel

from surgery.core.registry import tp_plan_for
from surgery.core.walk import outermost
from surgery.parallel.transformers_plans import stock_plan


def per_head_norm(head_dim: int = 2) -> SequenceParallel:
    """The style for a norm applied to each rank's own heads (QK-norm on `[batch, seq, heads, head_dim]`).

    Its weight becomes a replicated DTensor and its input is declared sharded on the heads dim, so gradients of the
    weight are summed over ranks; no collective runs in forward.
    """
    return SequenceParallel(sequence_dim=head_dim, use_local_output=True)


def planned_modules(model: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    """`(path, module, plan)` for every module with a registered plan (outermost only; keys that exist only), then
    those that transformers' own plan names (`surgery.parallel.transformers_plans`), outside the registered ones."""

    def match(module: nn.Module) -> dict | None:
        plan, _ = tp_plan_for(module)
        if plan is None:
            return None
        return {key: style for key, style in plan.items() if key == "" or _has_submodule(module, key)}

    registered_plans = outermost(model, match)
    covered = [path for path, _, _ in registered_plans]

    def inside(path: str) -> bool:
        return any(p == "" or path == p or path.startswith(p + ".") for p in covered)

    # Modules no registered plan covers, where the model carries transformers' own plan (a text encoder).
    return registered_plans + stock_plan(model, skip=inside)


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def block_path(model: nn.Module, path: str) -> tuple[str, bool]:
    """The enclosing transformer block: the path up to the first ModuleList element (True), else `path` (False)."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if isinstance(model.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[: i + 1]), True
    return path, False
