"""The rewrite registry: what each model family declares, and where `surgery` finds it.

Each module of the `rewrites` package exports `REWRITES`, a tuple of `Rewrite`s, and `TP_PLANS`, the stock
tensor-parallel plan of each module class it shards; both are loaded on first use. Other packages may add their own
with `register` and `register_tp_plan`.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from .slicing import Slice


def _always(module: nn.Module) -> bool:
    return True


def _no_check(module: nn.Module, path: str, verb: str) -> None:
    return None


@dataclass(frozen=True)
class Rewrite:
    """One fused module class and its equivalent unfused form.

    `slices(module)` lists, for either form, which rows/columns of each fused parameter each unfused parameter is.
    `build_unfused` / `build_fused` return the other form's structure on the meta device, sharing every submodule that
    is not a slice target; the engine fills the slice targets. Neither builder may mutate its argument.
    """

    name: str
    fused: type[nn.Module]
    unfused: type[nn.Module]
    slices: Callable[[nn.Module], list[Slice]]
    build_unfused: Callable[[nn.Module], nn.Module]
    build_fused: Callable[[nn.Module], nn.Module]
    is_fused: Callable[[nn.Module], bool] = field(default=_always)
    # Family-specific checks run before anything changes, on either form: `check(module, path, verb)`.
    check: Callable[[nn.Module, str, str], None] = field(default=_no_check)
    # False where diffusers checkpoints never hold the fused keys (a run-time fusion like `fuse_qkv_projections`).
    in_checkpoints: bool = True

    def matches_fused(self, module: nn.Module) -> bool:
        return type(module) is self.fused and self.is_fused(module)

    def matches_unfused(self, module: nn.Module) -> bool:
        return type(module) is self.unfused


_registry: list[Rewrite] = []
_tp_plans: dict[type[nn.Module] | str, dict] = {}
_tp_checks: dict[type[nn.Module] | str, Callable[[nn.Module, str, int], None]] = {}
_builtins_loaded = False


def register(*rewrites: Rewrite) -> None:
    """Add rewrites for a model family that lives outside the `rewrites` package."""
    for rewrite in rewrites:
        if any(r.name == rewrite.name for r in _registry):
            raise ValueError(f"A rewrite named {rewrite.name!r} is already registered.")
        _registry.append(rewrite)


def register_tp_plan(
    cls: type[nn.Module] | str, plan: dict, check: Callable[[nn.Module, str, int], None] | None = None
) -> None:
    """Declare how `surgery.tensor_parallel` shards modules of exactly class `cls`.

    `cls` may be a class or its qualified name ("package.module.Class"), so that a family's plans cost no import of
    the library that defines it. `plan` maps submodule paths relative to the module to stock `ParallelStyle`s; the
    key `""` is the module itself. `check(module, path, world_size)` raises `SurgeryError` for sizes the mesh cannot
    split (beyond the generic checks).
    """
    _tp_plans[cls] = plan
    if check is not None:
        _tp_checks[cls] = check


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    import rewrites

    for info in pkgutil.iter_modules(rewrites.__path__):
        family = importlib.import_module(f"rewrites.{info.name}")
        register(*family.REWRITES)
        checks = getattr(family, "TP_CHECKS", {})
        for cls, plan in getattr(family, "TP_PLANS", {}).items():
            register_tp_plan(cls, plan, checks.get(cls))


def registered() -> tuple[Rewrite, ...]:
    """Every registered rewrite, loading the `rewrites` package's modules on first call."""
    _load_builtins()
    return tuple(_registry)


def tp_plan_for(module: nn.Module) -> tuple[dict | None, Callable | None]:
    """The registered plan and check for `module`'s exact class (by class or by qualified name)."""
    _load_builtins()
    cls = type(module)
    key = cls if cls in _tp_plans else qualified_name(cls)
    return _tp_plans.get(key), _tp_checks.get(key)


def tp_plans() -> dict[type[nn.Module] | str, dict]:
    """Every registered tensor-parallel plan, by module class (or qualified class name)."""
    _load_builtins()
    return dict(_tp_plans)
