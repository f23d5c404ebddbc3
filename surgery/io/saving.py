"""Save any model (fused, unfused, or sharded with tensor parallelism) as the stock diffusers checkpoint.

`surgery.save_pretrained(model, folder)` writes what `fuse` + diffusers' `save_pretrained` would write: the fused
(diffusers) layout, diffusers' shard names and index, and `config.json`, into a temporary sibling folder that is
swapped into place when complete (`surgery.io.atomic`, which keeps the folder's other files). It holds about one tensor
in memory beyond the model:

- an unsharded model: each tensor of the fused layout is written from its parts one block of rows at a time, by the
  writer `convert_checkpoint` uses too (`surgery.io.safetensors_writer`: diffusers' shard names and index, each file
  byte for byte as safetensors writes it, fsynced);
- a tensor-parallel model: torch's distributed checkpoint (`torch.distributed.checkpoint`, its Hugging Face
  safetensors writer) writes every rank's shards and consolidates them into full tensors of the unfused layout, one
  file per tensor; rank 0 then streams those into diffusers' fused layout and shard files, as above.

`state_dict()` itself stays in the unfused layout (its keys match `named_parameters()`), which torch's distributed
checkpoint, FSDP2, PEFT and optimizers rely on; `fused_layout(model)` turns it fused for the length of one
`save_pretrained` call.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from diffusers.utils.torch_utils import unwrap_module
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
import secrets
import torch.distributed.checkpoint as dcp

from surgery.core.errors import SurgeryError
from surgery.core.heads_padding import trims
from surgery.core.slicing import Slice, concat, fused_shape, group_by_fused
from surgery.core.state_dict import checkpoint_slices
from surgery.io.atomic import Staged, destination, staged_folder
from surgery.io.safetensors_writer import (
    DEFAULT_MAX_SHARD_SIZE, DTYPES, Entry, Part, owns, shard_bytes, write_checkpoint,
)
from surgery.core.prequantized import gguf_weight, type_name
from surgery.parallel.agreement import agree, agree_and_share
from surgery.parallel.quantized import quantized


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is a DTensor (after `tensor_parallel` or `load_tensor_parallel`)."""

    return any(isinstance(t, DTensor) for t in (*model.parameters(), *model.buffers()))


def fused_order(names: list[str], slices: list[Slice]) -> list[tuple[str, list[Slice] | None]]:
    """The fused layout's keys in the order the fused model lists them, from a state dict's `names` (either layout).

    Each fused key takes the place of its first part (to_qkv_mlp_proj where to_q was, ...), which is the stock
    module's parameter order. `(name, None)` is a key copied as it is; `(fused name, slices)` joins its parts.
    """
    groups = dict(group_by_fused(slices))
    first_part = {group[0].unfused: (fused, group) for fused, group in groups.items()}
    parts = {s.unfused for s in slices}
    out: list[tuple[str, list[Slice] | None]] = []
    present = set(names)
    for name in names:
        if name in first_part:
            fused, group = first_part[name]
            # `to_out.weight` is a key in both layouts: only a full set of parts is the unfused layout
            if all(s.unfused in present for s in group) and (len(group) > 1 or fused != name):
                out.append((fused, group))
                continue
        if name in parts and name not in groups:
            continue  # a later part of a fused key emitted above
        out.append((name, None))
    return out


@contextmanager
def fused_layout(model: nn.Module) -> Iterator[None]:
    """While inside, `model.state_dict()` is in the fused (diffusers) layout: what diffusers' `save_pretrained` reads.

    A state-dict hook on `model` only, removed on exit: nobody else sees fused keys.
    """
    slices = checkpoint_slices(model)

    def hook(module, state_dict, prefix, local_metadata):
        names = [k[len(prefix):] for k in state_dict if k.startswith(prefix)]
        values = {name: state_dict.pop(prefix + name) for name in names}
        for name, group in fused_order(names, [s for s in slices if s.unfused in values]):
            if group is None:
                state_dict[prefix + name] = values[name]
            else:
                state_dict[prefix + name] = concat([values[s.unfused] for s in group], group[0].dim)[0]
        return state_dict

    handle = model._register_state_dict_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# --- where tensors come from: the model's own tensors, or full tensors that DCP consolidated ----------------------


class _ModelTensors:
    """Full tensors of an unsharded model's state dict."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.tensors = {k: v.detach() for k, v in state_dict.items()}

    def names(self) -> list[str]:
        return list(self.tensors)

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = self.tensors[name]
        return t.dtype, tuple(t.shape)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        t = self.tensors[name]
        return (t if rows is None else t[rows]).cpu()


class _FileTensors:
    """Full tensors in safetensors files (DCP's consolidated output), read one tensor or one block of rows at a time.

    Each read opens its file and lets it go, so that no file stays mapped (a model's worth of files, one per tensor).
    """

    def __init__(self, folder: Path, order: list[str]):
        # DCP's own output (`model-0000k-of-0000n.safetensors`, written by us a moment ago): every file is read, not
        # only the names diffusers would pick.
        self.files = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                self.files.update({name: file for name in f.keys()})
        self.order = order

    def names(self) -> list[str]:
        return self.order

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        with safe_open(self.files[name], "pt") as f:
            piece = f.get_slice(name)
            return DTYPES[piece.get_dtype()], tuple(piece.get_shape())

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name) if rows is None else f.get_slice(name)[rows]


class _RealHeads:
    """`source` with the zero heads of a padded model cut off (`surgery.core.heads_padding.trims`): the real rows of
    q/k/v, the real columns of the output projections."""

    def __init__(self, source, trims: dict[str, tuple[int, int]]):
        self.source, self.trims = source, trims

    def names(self) -> list[str]:
        return self.source.names()

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        dtype, shape = self.source.meta(name)
        if name in self.trims:
            dim, real = self.trims[name]
            shape = (*shape[:dim], real, *shape[dim + 1:])
        return dtype, shape

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        if name not in self.trims:
            return self.source.read(name, rows)
        dim, real = self.trims[name]
        if dim == 0:  # the real rows come first: a block of them is a block of the padded tensor's
            start, stop, _ = (rows or slice(None)).indices(real)
            return self.source.read(name, slice(start, stop))
        return self.source.read(name, rows).narrow(dim, 0, real).contiguous()


def _entries(source, slices: list[Slice]) -> list[Entry]:
    """Every tensor of the fused layout, in the fused model's order, each joined from its parts in `source`."""
    entries: list[Entry] = []
    for name, group in fused_order(source.names(), slices):
        names = [name] if group is None else [s.unfused for s in group]
        metas = [source.meta(n) for n in names]
        parts = tuple(Part(shape[0] if shape else 0, partial(source.read, n)) for n, (_, shape) in zip(names, metas))
        dtype, shape = metas[0]
        if group is None:
            entries.append(Entry(name, dtype, shape, parts))
        else:
            entries.append(Entry(name, dtype, fused_shape(shape, group), parts, group[0].dim))
    return entries


VERB = "surgery.save_pretrained"


def _check(model: nn.Module, folder, max_shard_size) -> Path:
    """Every refusal of a save, before anything is written; returns the destination, resolved."""

    if not hasattr(model, "save_config"):
        raise SurgeryError(
            f"{VERB}: {type(model).__name__} is not a diffusers model (no save_config); pass the "
            "transformer, e.g. pipe.transformer."
        )
    target = destination(folder, VERB)
    shard_bytes(max_shard_size)
    if getattr(model, "hf_quantizer", None) is not None:
        raise SurgeryError(f"{VERB}: the model is quantized; save it with model.save_pretrained.")
    _check_plain(model)
    peft = [n for n, m in model.named_modules() if hasattr(m, "base_layer")]
    if peft:
        raise SurgeryError(
            f"{VERB}: '{peft[0]}' is wrapped by a LoRA adapter. Save the adapter with "
            "save_lora_adapter, or merge it first (model.fuse_lora(); model.unload_lora())."
        )
    return target


def _check_plain(model: nn.Module) -> None:
    """Only plain weights are written: a torchao or GGUF tensor (quantized by the user, or read per rank by
    load_tensor_parallel) would fail deep inside the write, or be written as something diffusers cannot read."""
    for name, param in model.named_parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if quantized(param) or quantized(local) or type(local) not in (torch.Tensor, nn.Parameter):
            tensor = param if quantized(param) else local
            kind = (f"GGUF {type_name(tensor.ggml_type)} bytes" if gguf_weight(tensor)
                    else f"a {type(tensor).__module__.split('.')[0]} {type(tensor).__name__}")
            raise SurgeryError(
                f"{VERB}: '{name}' of '{name.rpartition('.')[0]}' is quantized ({kind}); a diffusers checkpoint "
                "holds plain weights. Save the model before quantizing it and quantize again after loading, or keep "
                "the quantized file it was loaded from (load_tensor_parallel reads it per rank)."
            )


def save_pretrained(
    model: nn.Module, folder: str | os.PathLike, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    variant: str | None = None,
) -> Path:
    """Write `model` (fused, unfused or tensor-parallel) as the stock diffusers checkpoint in `folder`; returns it.

    The files are what `surgery.fuse(model).save_pretrained(folder, max_shard_size=...)` writes (diffusers' shard
    names, index and `config.json`), so stock `from_pretrained` loads them. The save owns only those files: they are
    written into a temporary sibling and swapped into place when complete (`surgery.io.atomic`), and every other file of
    an existing `folder` (a README, LoRA weights, `samples/`) is kept; a `torch.compile`d model saves as the model it
    wraps. A pipeline's root folder is refused (pass its `transformer/`); a second save to the same folder while one
    runs is refused. A tensor-parallel model must be
    saved from every rank at once, to one folder every rank sees (rank 0 writes the final files); a rank that never
    calls it makes the others raise after `SURGERY_HANDSHAKE_TIMEOUT` seconds (default 30). Returns the folder,
    resolved.
    """
    model = unwrap_module(model)  # `torch.compile(model)` saves as the model it wraps, as diffusers' pipelines do
    if not is_sharded(model):
        target = _check(model, folder, max_shard_size)
        slices = checkpoint_slices(model)
        with staged_folder(target, owns, VERB) as staged:
            source = _RealHeads(_ModelTensors(model.state_dict()), trims(model))
            write_checkpoint(staged, _entries(source, slices), max_shard_size, variant)
            model.save_config(staged)
        return target
    return _save_sharded(model, folder, max_shard_size, variant)


def _own_failure(error: BaseException, rank: int) -> BaseException | None:
    """This rank's own error inside torch's distributed checkpoint, which wraps every rank's into one
    `CheckpointException` raised on all of them (None when this rank's part succeeded)."""

    if not isinstance(error, CheckpointException):
        return error
    mine = error.failures.get(rank)
    return None if mine is None else mine[0]


def _save_sharded(model: nn.Module, folder, max_shard_size, variant) -> Path:
    """Every rank: checks and a handshake, then torch's distributed checkpoint into a temporary folder that rank 0
    creates; rank 0 streams it into the fused layout and swaps it into place. Four small exchanges (`agree`) make a
    failure on any rank raise on every rank, naming that rank and its own error."""



    if not dist.is_initialized():
        raise SurgeryError(f"{VERB}: the model is sharded but torch.distributed is not initialized.")
    rank = dist.get_rank()
    staged: Staged | None = None
    marker = ".surgery-save"

    def prepare() -> tuple[Path, str | None, str | None]:
        nonlocal staged
        target = _check(model, folder, max_shard_size)
        if rank != 0:
            return target, None, None
        staged = Staged(target, owns, VERB)
        token = secrets.token_hex(8)
        (staged.path / marker).write_text(token)
        return target, staged.path.name, token

    def discard(view: Path | None) -> None:
        if staged is not None:
            staged.discard()
        elif view is not None:
            shutil.rmtree(view, ignore_errors=True)

    try:
        (target, _, _), shared = agree_and_share(None, "save_pretrained", prepare, lambda r: (r[0].name, *r[1:]))
    except BaseException:
        discard(None)
        raise
    names = [name for name, _, _ in shared]
    _, staged_name, token = shared[0]
    tmp = target.parent / staged_name

    def same_folder():
        # before anything is written: every rank names the same folder and sees the one rank 0 created
        if names[rank] != names[0]:
            raise SurgeryError(f"its folder '{target}' is not rank 0's (named '{names[0]}'): pass the same folder on "
                               "every rank.")
        try:
            seen = (tmp / marker).read_text()
        except OSError:
            seen = None
        if seen != token:
            raise SurgeryError(
                f"it does not see the temporary folder rank 0 created beside its destination ('{tmp}' is "
                "absent here): pass the same folder on every rank, on a file system that every rank shares."
            )
        state_dict = model.state_dict()
        # Every rank writes its own shards; DCP consolidates them (on rank 0) into full tensors, one file per tensor
        # so that no rank buffers more than one tensor. DCP names files `model-0000i-of-0000N` with its own index,
        # and cannot join the unfused parts into diffusers' fused keys: that pass follows, streaming.
        writer = HuggingFaceStorageWriter(
            str(tmp / "dcp"),
            fqn_to_index_mapping={name: i + 1 for i, name in enumerate(state_dict)},
            save_distributed=True,
            enable_consolidation=True,
        )
        return state_dict, writer

    try:
        state_dict, writer = agree(None, "save_pretrained", same_folder, handshake=False)
    except BaseException:
        discard(None)
        raise

    # From here to the next exchange the only collectives are DCP's, which catches every rank's error (KeyboardInterrupt
    # included) and raises them on all ranks as one CheckpointException; rank 0's own work follows, alone.
    error: BaseException | None = None
    others: BaseException | None = None
    try:
        order = list(state_dict)
        dcp.save(state_dict, storage_writer=writer)
        del state_dict
        if rank == 0:
            slices = checkpoint_slices(model)
            source = _RealHeads(_FileTensors(tmp / "dcp", order), trims(model))
            write_checkpoint(tmp, _entries(source, slices), max_shard_size, variant)
            shutil.rmtree(tmp / "dcp")
            (tmp / marker).unlink()
            model.save_config(tmp)
    except BaseException as caught:  # noqa: BLE001 - every rank hears of it below, then it is raised
        error = _own_failure(caught, rank)
        if error is None:  # another rank's failure, which that rank reports below
            others = caught
    kept = f"'{target}' is as it was, the temporary folder removed"
    try:
        agree(None, "save_pretrained", lambda: _raise(error), during=f"while writing ({kept})", handshake=False)
        if others is not None:  # DCP raised on every rank, but no rank found its own failure in it: never commit
            raise SurgeryError(f"{VERB}: torch's distributed checkpoint failed ({kept}): {others}")
    except BaseException:
        discard(tmp)  # every rank, in case its view of the folder is its own
        raise
    replace_error: BaseException | None = None
    if staged is not None:
        try:
            staged.commit()  # the one rename; it removes the temporary folder itself if it fails
        except BaseException as caught:  # noqa: BLE001 - told to every rank below
            replace_error = caught
    agree(None, "save_pretrained", lambda: _raise(replace_error), during="while replacing the folder",
          handshake=False)
    return target


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
