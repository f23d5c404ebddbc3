"""Which attentions `tensor_parallel(..., pad_heads=True)` pads with zero heads, checked before anything changes.

An attention whose heads a mesh does not divide is padded up to a multiple of it (`surgery.core.heads_padding`:
zero q/k/v rows, zero output columns, appended after the real heads) instead of being refused. The roles of its
Linears are read off the plan, as the derivation names them: the colwise query/key/value projections (and per-head
gates, one row per head) get rows, the rowwise output projection (or a single-stream block's `attn_part`) columns.

Why zero heads and not uneven shards: DTensor shards like `torch.chunk` (ceil-sized pieces), so an uneven split of
`heads x head_dim` columns cuts inside a head unless the widths happen to align; padded, every rank holds the same
number of whole heads under the stock styles, and saving, loading and adapters keep working on even shards.

Refused, with the reason: a norm over the whole attention width (its statistic would count the zero heads), rotary
tables laid across the width, a multi-query attention's key/value head kept whole (zero query heads would attend to
it: their outputs, and so their output columns' gradients, are not zero), and any Linear the rule cannot tell is about
heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.checks import mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.core.heads_padding import HeadPadding
from surgery.core.split_projection import ATTN_PART
from surgery.parallel.derive import (
    INPUT_PROJECTIONS, KEYS, OUTPUT_PROJECTIONS, QK_NORMS, RotaryAcrossWidth, head_count, is_attention, norm_width,
    query_projection, whole_key_values,
)

# the rows of q/k/v: the derivation's names, and a `SplitRows`' parts (FLUX.2's `to_qkv_mlp_proj.q`)
ROW_NAMES = frozenset(INPUT_PROJECTIONS) | {"q", "k", "v"}
KV_HEAD_COUNTS = ("kv_heads", "num_kv_heads")


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _up(n: int, world: int) -> int:
    return -(-n // world) * world


def _head_dim(attention: nn.Module, heads: int) -> int | None:
    head_dim = getattr(attention, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    q = query_projection(attention)
    return q.out_features // heads if isinstance(q, nn.Linear) else None


def _kv_heads(rows: dict[str, nn.Linear], heads: int, head_dim: int) -> int:
    """Key/value heads, read off the key projection's width (fewer than `heads` under grouped-query attention)."""
    return next((m.out_features // head_dim for key, m in rows.items() if key.rpartition(".")[2] in (*KEYS, "k")),
                heads)


def attention_padding(planned_module: nn.Module, plan: dict, attention_key: str, world: int,
                      where: str) -> HeadPadding | None:
    """The padding of the attention at `attention_key` (relative to `planned_module`, whose `plan` it is), or None
    where the mesh divides its heads. Raises `SurgeryError` where zero heads would not leave the output unchanged."""
    attention = planned_module.get_submodule(attention_key)
    heads = head_count(attention)
    head_dim = _head_dim(attention, heads)
    if head_dim is None and heads % world == 0:  # no zero heads needed (a mesh of 1, or one that divides them)
        return None
    if head_dim is None:
        raise SurgeryError(f"surgery.tensor_parallel: '{where}' has {heads} heads but no head size to pad by (no "
                           "`head_dim` and no `to_q` Linear).")
    inside = [(key, style) for key, style in plan.items()
              if key and (not attention_key or key.startswith(attention_key + "."))]
    rows = {key: planned_module.get_submodule(key) for key, style in inside
            if isinstance(style, ColwiseParallel) and key.rpartition(".")[2] in ROW_NAMES}
    gates = {key: planned_module.get_submodule(key) for key, style in inside if isinstance(style, ColwiseParallel)
             and key not in rows and getattr(planned_module.get_submodule(key), "out_features", None) == heads}
    columns = {key: planned_module.get_submodule(key) for key, style in inside
               if isinstance(style, RowwiseParallel) and (key[len(attention_key):].lstrip(".") in OUTPUT_PROJECTIONS
                                                          or key.rpartition(".")[2] == ATTN_PART)}
    if not columns:  # a single-stream block: the projection over cat([attention, mlp]) is the attention's sibling
        columns = {key: planned_module.get_submodule(key) for key, style in plan.items()
                   if key.rpartition(".")[2] == ATTN_PART and isinstance(style, RowwiseParallel)
                   and planned_module.get_submodule(key).in_features == heads * head_dim}
    kv = _kv_heads(rows, heads, head_dim)
    if heads % world == 0 and kv % world == 0:
        return None
    if whole_key_values(attention):
        raise SurgeryError(
            f"surgery.tensor_parallel: '{where}' has {heads} query heads over one key/value head, kept whole on "
            f"every rank: a zero query head would still attend to it, so its output is not zero and the output "
            f"projection's zero columns would be trained away. Use a mesh size that divides its {heads} heads: "
            f"{mesh_sizes_dividing(heads)}.")
    if not rows or not columns:
        raise SurgeryError(
            f"surgery.tensor_parallel: '{where}' has {heads} heads, which a mesh of {world} does not divide, and its "
            f"plan names no {'query/key/value projections' if not rows else 'output projection'} to pad with zero "
            "heads. Use a mesh size that divides its heads.")
    if kv != heads and (heads % kv or kv == 0):
        raise SurgeryError(f"surgery.tensor_parallel: '{where}' has {heads} query heads over {kv} key/value heads, "
                           "not whole groups; zero heads cannot keep each group with its key/value head.")
    for key, style in inside:  # a full-width gate of the attention output (to_gate) would need zero rows too
        linear = planned_module.get_submodule(key)
        if (isinstance(style, ColwiseParallel) and key not in rows and key not in gates
                and getattr(linear, "out_features", None) == heads * head_dim):
            raise SurgeryError(
                f"surgery.tensor_parallel: '{_join(where, key[len(attention_key):].lstrip('.'))}' is as wide as the "
                f"{heads} heads of '{where}' but not one of its q/k/v projections; whether zero heads would keep "
                "its output unchanged is unknown. Use a mesh size that divides its heads.")
    group = heads // kv
    padded_kv = _up(kv, world)
    padded = padded_kv * group if kv != heads else _up(heads, world)
    row_sizes = {}
    for key, linear in {**rows, **gates}.items():
        real = linear.out_features
        size = {heads * head_dim: padded * head_dim, kv * head_dim: padded_kv * head_dim, heads: padded}.get(real)
        if size is None:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{_join(where, key[len(attention_key):].lstrip('.'))}' has {real} output "
                f"features, not {heads} or {kv} heads of {head_dim}: it cannot be padded with zero heads.")
        row_sizes[key] = (real, size)
    column_sizes = {}
    for key, linear in columns.items():
        if linear.in_features != heads * head_dim:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{where}' output projection '{key}' reads {linear.in_features} features, "
                f"not {heads} heads of {head_dim}: it cannot be padded with zero heads.")
        column_sizes[key] = (linear.in_features, padded * head_dim)
    for name in QK_NORMS:
        norm = getattr(attention, name, None)
        width = norm_width(norm) if norm is not None and not isinstance(norm, nn.Identity) else None
        if width is not None and width != head_dim:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{_join(where, name)}' normalizes {width} features across the heads of "
                f"'{where}'; with zero heads its statistic would count them and change the output. Use a mesh size "
                f"that divides its {heads} heads.")
    if isinstance(plan.get(attention_key), RotaryAcrossWidth):
        raise SurgeryError(f"surgery.tensor_parallel: '{where}' rotates q/k across the whole width; its rotary tables "
                           f"hold {heads} heads, not {padded}. Use a mesh size that divides its {heads} heads.")
    attributes = {"heads" if hasattr(attention, "heads") else "num_heads": (heads, padded)}
    for name in KV_HEAD_COUNTS:
        if getattr(attention, name, None) == kv:
            attributes[name] = (kv, padded_kv)
    if getattr(attention, "inner_dim", None) == heads * head_dim:
        attributes["inner_dim"] = (heads * head_dim, padded * head_dim)
    if getattr(attention, "inner_kv_dim", None) == kv * head_dim:
        attributes["inner_kv_dim"] = (kv * head_dim, padded_kv * head_dim)
    return HeadPadding(attention_key, (heads, padded), (kv, padded_kv) if kv != heads else None, head_dim,
                       row_sizes, column_sizes, attributes)


@dataclass(frozen=True)
class Padded:
    """One padded attention: its block's path in the model, and the padding (paths relative to the block)."""

    block: str
    padding: HeadPadding


def head_paddings(model: nn.Module, planned: list, world: int, block_of) -> list[Padded]:
    """Every attention of the planned modules whose heads a mesh of `world` does not divide, with its padding;
    `block_of(path)` is the path of the block a planned module belongs to."""
    found = []
    for path, module, plan in planned:
        keys = [""] if is_attention(module) else [k for k, m in module.named_children() if is_attention(m)]
        for key in keys:
            if head_count(module.get_submodule(key)) is None:
                continue
            padding = attention_padding(module, plan, key, world, _join(path, key))
            if padding is None:
                continue
            block = block_of(path)
            offset = path[len(block):].lstrip(".")
            found.append(Padded(block, _relative(padding, offset)))
    return found


def _relative(padding: HeadPadding, offset: str) -> HeadPadding:
    """`padding` with its paths prefixed by `offset` (the planned module's path inside its block)."""
    move = lambda d: {_join(offset, k): v for k, v in d.items()}
    return HeadPadding(_join(offset, padding.attention), padding.heads, padding.kv_heads, padding.head_dim,
                       move(padding.rows), move(padding.columns), padding.attributes)


def cost(model: nn.Module, found: list[Padded], world: int) -> dict:
    """What the zero heads cost each rank, measured on the unpadded model: the bytes of the zero rows and columns
    (biases included), and the FLOPs they add per token (projections: 2 x the zero weights' elements) and per
    query-key pair (attention: 4 x head_dim per zero head), summed over the attentions. Every rank holds the same
    number of heads, so each pays a `world`-th of the total."""
    elements = nbytes = attention = 0
    for p in found:
        block = model.get_submodule(p.block)
        for key, (real, size) in [*p.padding.rows.items(), *p.padding.columns.items()]:
            linear = block.get_submodule(key)
            rows = key in p.padding.rows
            zeros = (size - real) * linear.weight.shape[1 if rows else 0]
            biases = size - real if rows and linear.bias is not None else 0
            elements += zeros
            nbytes += (zeros + biases) * linear.weight.element_size()
        attention += (p.padding.heads[1] - p.padding.heads[0]) * 4 * p.padding.head_dim
    return {
        "attentions": len(found),
        "heads": sorted({p.padding.heads for p in found}),
        "bytes_per_rank": nbytes // world,
        "projection_flops_per_token_per_rank": 2 * elements // world,
        "attention_flops_per_token_per_key_per_rank": attention // world,
    }
