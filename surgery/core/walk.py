"""Walking a model: the registered fused/unfused modules in it, and the modules a tensor-parallel plan covers.

A leaf of the engine (it imports only the registry): the rewrite verbs, tensor parallelism, the state-dict key map,
inspection and the diffusers interop all find their modules here.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.nn as nn

from surgery.core.registry import Rewrite, registered

T = TypeVar("T")


def outermost(model: nn.Module, match: Callable[[nn.Module], T | None]) -> list[tuple[str, nn.Module, T]]:
    """`(path, module, match(module))` for each module that `match` accepts, skipping those nested in one already found."""
    found: list[tuple[str, nn.Module, T]] = []
    inside: str | None = None  # the last module found: named_modules() lists its descendants right after it
    for path, module in model.named_modules():
        if inside is not None and (inside == "" or path.startswith(inside + ".")):
            continue
        hit = match(module)
        if hit is not None:
            found.append((path, module, hit))
            inside = path
    return found


def find_modules(model: nn.Module, fused: bool) -> list[tuple[str, nn.Module, Rewrite]]:
    """`(path, module, rewrite)` for every module in fused (or unfused) form, outermost first, not nested."""
    # A rewrite matches one exact class (`Rewrite.matches_fused`/`matches_unfused`): look up the module's class, then
    # ask only its rewrites, in registration order, rather than every rewrite about every module.
    by_class: dict[type, list[Rewrite]] = {}
    for rewrite in registered():
        by_class.setdefault(rewrite.fused if fused else rewrite.unfused, []).append(rewrite)

    def match(module: nn.Module) -> Rewrite | None:
        return next((r for r in by_class.get(type(module), ())
                     if (r.matches_fused if fused else r.matches_unfused)(module)), None)

    return outermost(model, match)


