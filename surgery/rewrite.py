"""`unfuse` and `fuse`: walk a model, swap every registered fused module for its unfused form, or back.

Both verbs check everything first and only then swap modules, one at a time, so peak memory grows by one module's
column copies at most. Should a swap still fail (out of memory), the modules already swapped are converted back with
the exact inverse before the error propagates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.nn as nn

from .checks import SurgeryError, check_hooks, check_linear, check_model
from .registry import Rewrite, registered
from .slicing import Slice, concat, group_by_fused, take


@dataclass(frozen=True)
class RewriteRecord:
    """One module swapped by `unfuse` or `fuse`."""

    path: str
    before: str
    after: str
    slices: tuple[Slice, ...]  # parameter names relative to the model passed in
    bytes_copied: int


_REPORT_ATTR = "_surgery_report"
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


def last_report(model: nn.Module) -> list[RewriteRecord]:
    """What the last `unfuse` or `fuse` on `model` rewrote (empty if nothing)."""
    return list(getattr(model, _REPORT_ATTR, []))


def unfuse(model: nn.Module) -> nn.Module:
    """Swap every fused module in `model` for its equivalent unfused module, in place.

    Row slices (q, k, v, gate, up) are views of the fused weights' storage; column splits are copies. Idempotent; a
    model with nothing to rewrite is returned unchanged. Returns `model` (a new module only when `model` itself is a
    fused module). `surgery.last_report(model)` lists what was rewritten.
    """
    return _rewrite(model, unfusing=True)


def fuse(model: nn.Module) -> nn.Module:
    """The exact inverse of `unfuse`: stock module classes back in place, weights bitwise as the unfused ones hold them.

    Rows that are still adjacent views of one storage are joined without a copy. A never-unfused model is unchanged.
    """
    return _rewrite(model, unfusing=False)


def _rewrite(model: nn.Module, unfusing: bool) -> nn.Module:
    verb = "unfuse" if unfusing else "fuse"
    found = find_modules(model, fused=unfusing)
    if not found:
        return model
    check_model(model, verb)
    for path, module, rewrite in found:
        _check(module, path, rewrite, unfusing, verb)
    slots = _parent_slots(model, {id(module) for _, module, _ in found})

    records: list[RewriteRecord] = []
    root = model
    pending = found[::-1]
    del found  # hold no old module longer than its swap: its column-split weights are freed one module at a time
    done: list[tuple[nn.Module, Rewrite]] = []
    try:
        while pending:
            path, module, rewrite = pending.pop()
            new, copied = _convert(module, rewrite, unfusing)
            slices = tuple(s.prefixed(path) for s in rewrite.slices(module))
            records.append(RewriteRecord(path, type(module).__name__, type(new).__name__, slices, copied))
            root = _swap(root, slots, module, new)
            done.append((new, rewrite))
            del module
    except BaseException:
        for new, rewrite in reversed(done):
            old, _ = _convert(new, rewrite, not unfusing)
            root = _swap(root, slots, new, old)
        raise
    object.__setattr__(root, _REPORT_ATTR, records)
    from .tensor_parallel import sync_diffusers_tp_plans  # imports this module

    sync_diffusers_tp_plans(root)
    from . import diffusers_hooks  # imports this module

    diffusers_hooks.install(root)
    return root


def _param(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _check(module: nn.Module, path: str, rewrite: Rewrite, unfusing: bool, verb: str) -> None:
    """Everything `_convert` relies on, checked before any module of the model is swapped."""
    check_hooks(module, path, verb)
    rewrite.check(module, path, verb)
    slices = rewrite.slices(module)
    sources = sorted({s.fused if unfusing else s.unfused for s in slices})
    for name in sources:
        owner = name.rpartition(".")[0]
        try:
            linear = module.get_submodule(owner)
            _param(module, name)
        except AttributeError:
            raise SurgeryError(
                f"surgery.{verb}: '{path}' ({type(module).__name__}) has no parameter '{name}', which its "
                f"{rewrite.name} rewrite reads. Was the module edited after it was built?"
            ) from None
        linear_path = f"{path}.{owner}" if path else owner
        check_linear(linear, linear_path, verb)
        check_hooks(linear, linear_path, verb)

    for fused_name, group in group_by_fused(slices):
        dim = group[0].dim
        if unfusing:
            tensor = _param(module, fused_name)
            expected = group[-1].stop
            if tensor.dim() <= dim or tensor.shape[dim] != expected:
                raise SurgeryError(
                    f"surgery.{verb}: '{path}.{fused_name}' has shape {tuple(tensor.shape)}, but "
                    f"{type(module).__name__}'s dimensions give {expected} along dim {dim}. Its attributes "
                    "(heads, head_dim, mlp_hidden_dim) no longer describe its weights."
                )
            continue
        parts = [_param(module, s.unfused) for s in group]
        for s, part in zip(group, parts):
            if part.dim() <= dim or part.shape[dim] != s.size:
                raise SurgeryError(
                    f"surgery.{verb}: '{path}.{s.unfused}' has shape {tuple(part.shape)}, but "
                    f"{type(module).__name__}'s dimensions give {s.size} along dim {dim}."
                )
        for attr in ("dtype", "device", "requires_grad"):
            values = {getattr(p, attr) for p in parts}
            if len(values) > 1:
                names = ", ".join(f"{s.unfused}={getattr(p, attr)}" for s, p in zip(group, parts))
                raise SurgeryError(
                    f"surgery.{verb}: the parts of '{path}.{fused_name}' differ in {attr} ({names}), which one fused "
                    f"parameter cannot hold. Give them the same {attr} first."
                )


def _set_param(root: nn.Module, name: str, tensor: torch.Tensor, requires_grad: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=requires_grad))


def _convert(module: nn.Module, rewrite: Rewrite, unfusing: bool) -> tuple[nn.Module, int]:
    """The other form of `module`, its slice targets filled from `module`'s parameters; and the bytes copied."""
    slices = rewrite.slices(module)
    target = rewrite.build_unfused(module) if unfusing else rewrite.build_fused(module)
    copied = 0
    if unfusing:
        for s in slices:
            source = _param(module, s.fused)
            piece, n = take(source, s)
            _set_param(target, s.unfused, piece, source.requires_grad)
            copied += n
    else:
        for fused_name, group in group_by_fused(slices):
            parts = [_param(module, s.unfused) for s in group]
            whole, n = concat(parts, group[0].dim)
            _set_param(target, fused_name, whole, parts[0].requires_grad)
            copied += n
    target.train(module.training)
    if not any(p.is_meta for p in module.parameters()):
        unfilled = [name for name, p in target.named_parameters() if p.is_meta]
        if unfilled:
            raise RuntimeError(f"rewrite {rewrite.name!r} built a {type(target).__name__} with {unfilled} unfilled.")
    return target, copied


def _parent_slots(model: nn.Module, ids: set[int]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every `(parent, child name)` slot that holds one of the modules in `ids`."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None and id(child) in ids:
                slots.setdefault(id(child), []).append((parent, name))
    return slots


def _swap(root: nn.Module, slots: dict, old: nn.Module, new: nn.Module) -> nn.Module:
    """Put `new` wherever `old` was; returns the new root if `old` was the root."""
    places = slots.pop(id(old), [])
    for parent, name in places:
        setattr(parent, name, new)
    slots[id(new)] = places
    return new if root is old else root
