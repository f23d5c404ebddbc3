"""Fused <-> unfused state-dict keys, as slices: what the sharded loader and the converter read."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from .checks import SurgeryError
from .walk import find_modules
from .slicing import Slice, concat, group_by_fused, take


def key_map(model: nn.Module) -> list[Slice]:
    """Every checkpoint slice of `model` (fused or unfused, or a mix): fused key, unfused key, dim, rows/columns.

    Keys not listed are the same in both layouts. Works on the meta device.
    """
    slices: list[Slice] = []
    for fused in (True, False):
        for path, module, rewrite in find_modules(model, fused=fused):
            if rewrite.in_checkpoints:
                slices += [s.prefixed(path) for s in rewrite.slices(module)]
    return slices


def _missing(state_dict: Mapping[str, torch.Tensor], keys: list[str], layout: str) -> None:
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise KeyError(f"The {layout} state dict lacks {len(missing)} key(s) the key map needs, first {missing[0]!r}.")


def _check_fused(name: str, tensor: torch.Tensor, group: list[Slice]) -> None:
    """The fused tensor is exactly its slices: no rows or columns left over (they would be silently dropped)."""
    dim, total = group[0].dim, group[-1].stop
    if tensor.dim() <= dim or tensor.shape[dim] != total:
        length = tensor.shape[dim] if tensor.dim() > dim else None
        raise SurgeryError(
            f"{name!r} has {length} entries along dim {dim}; its {len(group)} slices ({group[0].unfused!r}, ...) "
            f"cover exactly {total}: a tensor of another config (mlp_ratio, heads)? Nothing was converted."
        )


def _check_parts(name: str, parts: list[torch.Tensor], group: list[Slice]) -> None:
    """The parts of one fused tensor: each exactly its slice's size, equal elsewhere, one dtype."""
    dim, first = group[0].dim, parts[0]
    for s, part in zip(group, parts):
        if part.dim() <= dim or part.shape[dim] != s.size:
            raise SurgeryError(f"{s.unfused!r} has shape {tuple(part.shape)}, the slice {s.start}:{s.stop} of "
                               f"{name!r} along dim {dim} needs {s.size} entries. Nothing was converted.")
        if part.dtype != first.dtype or [n for d, n in enumerate(part.shape) if d != dim] != \
                [n for d, n in enumerate(first.shape) if d != dim]:
            raise SurgeryError(f"{s.unfused!r} is {part.dtype} {tuple(part.shape)}, its sibling {group[0].unfused!r} "
                               f"is {first.dtype} {tuple(first.shape)}: they cannot form {name!r}.")


def unfuse_state_dict(state_dict: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict[str, torch.Tensor]:
    """A fused (diffusers) state dict in the unfused layout. Row slices are views; column slices are copies."""
    _missing(state_dict, sorted({s.fused for s in slices}), "fused")
    sources = {s.fused for s in slices}
    for fused_name, group in group_by_fused(slices):
        _check_fused(fused_name, state_dict[fused_name], group)
    out = {k: v for k, v in state_dict.items() if k not in sources}
    for s in slices:
        out[s.unfused] = take(state_dict[s.fused], s)[0]
    return out


def fuse_state_dict(state_dict: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict[str, torch.Tensor]:
    """An unfused state dict in the fused (diffusers) layout; rows that are adjacent views are joined without a copy."""
    _missing(state_dict, [s.unfused for s in slices], "unfused")
    targets = {s.unfused for s in slices}
    for fused_name, group in group_by_fused(slices):
        _check_parts(fused_name, [state_dict[s.unfused] for s in group], group)
    out = {k: v for k, v in state_dict.items() if k not in targets}
    for fused_name, group in group_by_fused(slices):
        out[fused_name] = concat([state_dict[s.unfused] for s in group], group[0].dim)[0]
    return out
