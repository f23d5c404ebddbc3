"""Fused <-> unfused state-dict keys, as slices: what the sharded loader and the converter read."""

from __future__ import annotations


from typing import Mapping

import torch
import torch.nn as nn

from surgery.core.errors import SurgeryError
from surgery.core.heads_padding import real_slices, trims
from surgery.core.walk import find_modules
from surgery.core.slicing import Slice, concat, group_by_fused, take


def weight_slices(model: nn.Module) -> list[Slice]:
    """Every checkpoint slice of `model` (fused or unfused, or a mix): fused key, unfused key, dim, rows/columns.

    Keys not listed are the same in both layouts. Works on the meta device.
    """
    slices: list[Slice] = []
    for fused in (True, False):
        for path, module, rewrite in find_modules(model, fused=fused):
            if rewrite.in_checkpoints:
                slices += [s.prefixed(path) for s in rewrite.slices(module)]
    return slices


def checkpoint_slices(model: nn.Module) -> list[Slice]:
    """`weight_slices` of the checkpoint `model` saves: a model padded with zero heads
    (`tensor_parallel(..., pad_heads=True)`) at its real heads, the zero ones never written."""
    return real_slices(weight_slices(model), trims(model))


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


def _both_layouts(state_dict: Mapping[str, torch.Tensor], slices: list[Slice], layout: str) -> None:
    """Refuse a state dict that holds a fused key and its unfused parts: one of them would silently win."""
    fused = {s.fused for s in slices}
    parts = {s.unfused for s in slices}
    other = sorted((parts - fused) if layout == "fused" else (fused - parts))
    found = [k for k in other if k in state_dict]
    if found:
        group = next(g for _, g in group_by_fused(slices) if found[0] in {s.fused for s in g} | {s.unfused for s in g})
        raise SurgeryError(
            f"the {layout} state dict also holds {found[0]!r} of the other layout ({len(found)} such key(s)), beside "
            f"{group[0].fused!r} / {group[0].unfused!r}: which should win is ambiguous. Pass one layout only. Nothing "
            "was converted."
        )


def unfuse_state_dict(state_dict: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict[str, torch.Tensor]:
    """A fused (diffusers) state dict in the unfused layout. Row slices are views; column slices are copies."""
    _missing(state_dict, sorted({s.fused for s in slices}), "fused")
    _both_layouts(state_dict, slices, "fused")
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
    _both_layouts(state_dict, slices, "unfused")
    targets = {s.unfused for s in slices}
    for fused_name, group in group_by_fused(slices):
        _check_parts(fused_name, [state_dict[s.unfused] for s in group], group)
    out = {k: v for k, v in state_dict.items() if k not in targets}
    for fused_name, group in group_by_fused(slices):
        out[fused_name] = concat([state_dict[s.unfused] for s in group], group[0].dim)[0]
    return out
