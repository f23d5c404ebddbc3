"""Walking a model: the registered fused/unfused modules in it, and the modules a tensor-parallel plan covers.

A leaf of the engine (it imports only the registry): the rewrite verbs, tensor parallelism, the state-dict key map,
inspection and the diffusers interop all find their modules here.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.nn as nn

from .registry import Rewrite, registered, tp_plan_for

T = TypeVar("T")


def outermost(model: nn.Module, match: Callable[[nn.Module], T | None]) -> list[tuple[str, nn.Module, T]]:
    """`(path, module, match(module))` for each module that `match` accepts, skipping those nested in one already found."""
    found: list[tuple[str, nn.Module, T]] = []
    for path, module in model.named_modules():
        if any(p == "" or path == p or path.startswith(p + ".") for p, _, _ in found):
            continue
        hit = match(module)
        if hit is not None:
            found.append((path, module, hit))
    return found


def find_modules(model: nn.Module, fused: bool) -> list[tuple[str, nn.Module, Rewrite]]:
    """`(path, module, rewrite)` for every module in fused (or unfused) form, outermost first, not nested."""
    rewrites = registered()

    def match(module: nn.Module) -> Rewrite | None:
        return next((r for r in rewrites if (r.matches_fused if fused else r.matches_unfused)(module)), None)

    return outermost(model, match)


def planned_modules(model: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    """`(path, module, plan)` for every module with a registered plan (outermost only; keys that exist only), then
    those that transformers' own plan names (`surgery.transformers_plans`), outside the registered ones."""

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
    from .transformers_plans import stock_plan

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
