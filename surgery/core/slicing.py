"""Weight slicing: unfused parts are views of the fused storage (rows and columns alike); `take` copies columns
(for state dicts and files, which want contiguous tensors).

A `Slice` names one piece of a fused parameter and the unfused parameter it becomes. The same table drives
`unfuse`, `fuse`, the state-dict conversions, the sharded loader and the inspection views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Slice:
    """`fused[start:stop]` along `dim` is the whole of `unfused` (names are relative to a module or a model)."""

    fused: str
    unfused: str
    dim: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def unfused_shape(self, fused_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the unfused parameter cut from a fused one of `fused_shape`."""
        return tuple(self.size if d == self.dim else n for d, n in enumerate(fused_shape))

    def prefixed(self, prefix: str) -> "Slice":
        if not prefix:
            return self
        return Slice(f"{prefix}.{self.fused}", f"{prefix}.{self.unfused}", self.dim, self.start, self.stop)


def group_by_fused(slices: list[Slice]) -> list[tuple[str, list[Slice]]]:
    """Slices grouped by fused parameter, in first-seen order, each group in order along its dim."""
    groups: dict[str, list[Slice]] = {}
    for s in slices:
        groups.setdefault(s.fused, []).append(s)
    return [(name, sorted(group, key=lambda s: s.start)) for name, group in groups.items()]


def fused_shape(part_shape: tuple[int, ...], group: list[Slice]) -> tuple[int, ...]:
    """The shape of the fused parameter that `group` (one fused parameter's slices, in order) covers."""
    dim = group[0].dim
    return tuple(group[-1].stop if d == dim else n for d, n in enumerate(part_shape))


def take(tensor: torch.Tensor, s: Slice) -> tuple[torch.Tensor, int]:
    """This slice of `tensor` and the bytes copied to make it: a view for dim 0, a contiguous copy otherwise."""
    piece = tensor.detach().narrow(s.dim, s.start, s.size)
    if piece.is_contiguous():
        return piece, 0
    copy = piece.contiguous()
    return copy, 0 if copy.is_meta else copy.numel() * copy.element_size()


def back_to_back(tensors: list[torch.Tensor], dim: int) -> torch.Tensor | None:
    """The tensor whose consecutive slices along `dim` (0: rows, 1: columns of 2-D tensors) `tensors` are, as a view
    of their one storage; `None` where they do not lie so (another storage, a gap, another dtype or layout)."""
    first = tensors[0]
    if any(hasattr(t, "__tensor_flatten__") and not isinstance(t, DTensor) for t in tensors):
        return None  # a quantized weight (a wrapper of inner tensors) has no storage of its own
    if first.is_meta or any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return None
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    if dim == 0:
        if not all(t.is_contiguous() for t in tensors):
            return None
        step = [t.numel() for t in tensors]
        shape, stride = (sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride()
    else:
        width = sum(t.shape[1] for t in tensors)
        if any(t.dim() != 2 or t.stride() != (width, 1) or t.shape[0] != first.shape[0] for t in tensors):
            return None
        step = [t.shape[1] for t in tensors]
        shape, stride = (first.shape[0], width), (width, 1)
    for t, n in zip(tensors, step):
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += n
    # a view of the first tensor reaching over the rest of the storage (what torch.compile can trace through)
    return first.detach().as_strided(shape, stride, first.storage_offset())


def concat(parts: list[torch.Tensor], dim: int) -> tuple[torch.Tensor, int]:
    """`torch.cat(parts, dim)` and the bytes copied; a view (no copy) when row slices still share one storage."""
    parts = [p.detach() for p in parts]
    whole = back_to_back(parts, dim) if dim in (0, 1) else None
    if whole is not None:
        return whole, 0
    whole = torch.cat(parts, dim=dim)
    return whole, 0 if whole.is_meta else whole.numel() * whole.element_size()


def row_slices(fused: str, parts: list[tuple[str, int]], param: str = "weight") -> list[Slice]:
    """Consecutive row blocks of `<fused>.<param>`, one per `(unfused module, rows)` part, in order."""
    slices, start = [], 0
    for name, size in parts:
        slices.append(Slice(f"{fused}.{param}", f"{name}.{param}", 0, start, start + size))
        start += size
    return slices


def column_slices(
    fused: str, parts: list[tuple[str, int]], bias_to: str | None = None, bias_size: int = 0
) -> list[Slice]:
    """Consecutive column blocks of `<fused>.weight`, one per `(unfused module, columns)` part; the whole bias (a
    column split leaves it whole: `y = W[:, a] x_a + W[:, b] x_b + bias`) goes to `bias_to`, if given, with its
    `bias_size` (the output features)."""
    slices, start = [], 0
    for name, size in parts:
        slices.append(Slice(f"{fused}.weight", f"{name}.weight", 1, start, start + size))
        start += size
    return slices + ([Slice(f"{fused}.bias", f"{bias_to}.bias", 0, 0, bias_size)] if bias_to else [])
