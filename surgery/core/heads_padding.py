"""Zero heads: an attention whose heads a mesh does not divide, padded up to a multiple of it, and back.

A padded head has zero query/key/value rows (weights and biases) and zero columns in the output projection, so it
adds nothing to the output: its values are zero, so its attention output is zero whatever its scores are (a q/k
norm over `head_dim` maps a zero head to zero, or to its bias: finite either way), and the output projection's zero
columns read it as zero besides. Gradients of the padded rows and columns are zero for the same reasons (the scores'
gradient is the output's times the zero values; the values' gradient comes through the zero columns; the columns'
gradient is the output gradient times the zero attention output), so any optimizer that maps a zero gradient on a zero
weight to zero (SGD, Adam/AdamW with or without decay) keeps them zero.

The padding goes at the end of each projection's rows (and the output projection's columns): real heads keep their
indices, and with grouped-query attention the key/value heads are padded to a multiple of the mesh and the query
heads to that many groups, so query head i still reads key/value head i // group. What was padded is recorded on the
block (`PADDING`), so that saving, `fuse` and adapters give back the unpadded model and files.

The padding is found and checked by `surgery.parallel.padding`; this module only applies and undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from surgery.core.errors import SurgeryError
from surgery.core.slicing import Slice, group_by_fused

PADDING = "_surgery_head_padding"  # the attribute a block keeps its `HeadPadding`s under (never saved)


@dataclass(frozen=True)
class HeadPadding:
    """What padding one attention changes, paths relative to its block.

    `rows`: Linear path -> (real, padded) output features (q/k/v, per-head gates); `columns`: Linear path -> (real,
    padded) input features (the output projection); `attributes`: attention attribute -> (real, padded) value
    (`heads`, `inner_dim`, ... that its processor reads)."""

    attention: str
    heads: tuple[int, int]
    kv_heads: tuple[int, int] | None
    head_dim: int
    rows: dict[str, tuple[int, int]]
    columns: dict[str, tuple[int, int]]
    attributes: dict[str, tuple[int, int]]


def refusal_hint(world: int) -> str:
    """What a refusal of heads a mesh does not divide offers besides another mesh size."""
    return (f", or pass pad_heads=True to tensor_parallel to pad them with zero heads up to a multiple of {world} "
            "(exact; `surgery plan` shows what the padding costs per rank)")


def _resize(linear: nn.Linear, dim: int, size: int) -> None:
    """`linear`'s weight (and, for rows, its bias) cut or zero-padded to `size` along `dim`; same Parameter objects.

    Cutting leaves a view of the padded storage (the real values, bitwise); padding copies into a new buffer."""
    with torch.no_grad():
        for name in ("weight", "bias") if dim == 0 else ("weight",):
            param = getattr(linear, name)
            if param is None:
                continue
            have = param.shape[dim]
            if size <= have:
                param.data = param.data.narrow(dim, 0, size)
            else:
                shape = list(param.shape)
                shape[dim] = size - have
                param.data = torch.cat([param.data, param.data.new_zeros(shape)], dim)
    if dim == 0:
        linear.out_features = size
    else:
        linear.in_features = size


def _apply(block: nn.Module, padding: HeadPadding, which: int) -> None:
    for path, sizes in padding.rows.items():
        _resize(block.get_submodule(path), 0, sizes[which])
    for path, sizes in padding.columns.items():
        _resize(block.get_submodule(path), 1, sizes[which])
    attention = block.get_submodule(padding.attention)
    for name, values in padding.attributes.items():
        setattr(attention, name, values[which])


def pad(block: nn.Module, paddings: list[HeadPadding]) -> None:
    """Pad each attention of `block` as `paddings` say, and record it on the block."""
    for padding in paddings:
        _apply(block, padding, 1)
    setattr(block, PADDING, [*getattr(block, PADDING, []), *paddings])


def unpad_one(block: nn.Module, padding: HeadPadding) -> None:
    """Undo one attention's padding on an unsharded block (the last applied first)."""
    _apply(block, padding, 0)
    left = [p for p in getattr(block, PADDING, []) if p is not padding]
    if left:
        setattr(block, PADDING, left)
    elif hasattr(block, PADDING):
        delattr(block, PADDING)


def padded_blocks(model: nn.Module) -> list[tuple[str, nn.Module, list[HeadPadding]]]:
    """`(path, block, paddings)` for every padded block of `model` (the model itself included)."""
    return [(path, m, getattr(m, PADDING)) for path, m in model.named_modules() if getattr(m, PADDING, None)]


def unpad(model: nn.Module) -> nn.Module:
    """Give an unsharded padded model its real heads back (the real values bitwise); a no-op where nothing is padded.

    A sharded model keeps its padding (its shards are even only padded): save it with `surgery.save_pretrained`, which
    writes the unpadded checkpoint."""
    blocks = padded_blocks(model)
    for path, block, _ in blocks:
        sharded = [n for n, p in block.named_parameters() if isinstance(p, DTensor)]
        if sharded:
            where = ".".join(p for p in (path, sharded[0]) if p)
            raise SurgeryError(
                f"surgery: '{where}' is sharded with zero heads padded (tensor_parallel(..., pad_heads=True)); its "
                "real heads come back only whole. Save it with surgery.save_pretrained (the unpadded stock "
                "checkpoint) and load that.")
    for _, block, paddings in blocks:
        for padding in reversed(paddings):
            unpad_one(block, padding)
    return model


def trims(model: nn.Module) -> dict[str, tuple[int, int]]:
    """State-dict name -> (dim, real size) for every padded tensor of `model`: what a saved checkpoint keeps."""
    out: dict[str, tuple[int, int]] = {}
    for path, block, paddings in padded_blocks(model):
        for padding in paddings:
            for linear, (real, _) in padding.rows.items():
                module = block.get_submodule(linear)
                prefix = ".".join(p for p in (path, linear) if p)
                out[f"{prefix}.weight"] = (0, real)
                if module.bias is not None:
                    out[f"{prefix}.bias"] = (0, real)
            for linear, (real, _) in padding.columns.items():
                out[".".join(p for p in (path, linear) if p) + ".weight"] = (1, real)
    return out


def real_slices(slices: list[Slice], trimmed: dict[str, tuple[int, int]]) -> list[Slice]:
    """`slices` with each padded part at its real size (`trims`), the parts after it moved up: the checkpoint's
    fused layout of the unpadded model, whether a family computed the slices from live widths or attributes."""
    if not trimmed:
        return slices
    out: list[Slice] = []
    for _, group in group_by_fused(slices):
        start = group[0].start
        for s in group:
            dim, real = trimmed.get(s.unfused, (None, None))
            size = real if dim == s.dim else s.size
            out.append(Slice(s.fused, s.unfused, s.dim, start, start + size))
            start += size
    return out
