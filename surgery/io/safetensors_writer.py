"""The one safetensors writer: diffusers' shard files and index, each file streamed block by block and fsynced.

Both checkpoint writers use it: `convert_checkpoint` (tensors read slice by slice from another checkpoint) and
`save_pretrained` (tensors of a model, or full tensors that torch's distributed checkpoint consolidated). Each
describes every tensor to write as an `Entry`: its name, dtype and shape, and the `Part`s whose rows, joined along
`dim`, make it. Nothing else differs:

- `shard_plan` groups the entries into diffusers' shard files (`diffusion_pytorch_model[-0000k-of-0000n]
  [.<variant>].safetensors`) and index with huggingface_hub's splitter, the one diffusers' `save_pretrained` calls;
- `write_file` writes one file as safetensors' `save_file` lays it out (the header, then the tensors ordered by dtype
  then name), in blocks of rows of at most about `BLOCK_BYTES`, so that it holds about one block beyond the source;
- `write_checkpoint` writes a folder's files: every shard, then the index (as diffusers writes it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int

from surgery.core.errors import SurgeryError

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "10GB"  # diffusers' ModelMixin.save_pretrained default
BLOCK_BYTES = 16 * 2**20  # the most bytes of one tensor read and written at a time (one row where a row is larger)

# safetensors' dtype names, in the order safetensors lays tensors out in a file (then by name)
DTYPES = {
    "I64": torch.int64, "F64": torch.float64, "F32": torch.float32, "I32": torch.int32, "BF16": torch.bfloat16,
    "F16": torch.float16, "I16": torch.int16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_RANK = {dtype: rank for rank, dtype in enumerate(DTYPES.values())}


def add_variant(name: str, variant: str | None) -> str:
    """diffusers' `_add_variant`: the variant goes before the last suffix (`x.safetensors` -> `x.fp16.safetensors`)."""
    if variant is None:
        return name
    *stem, suffix = name.split(".")
    return ".".join([*stem, variant, suffix])


def owns(name: str) -> bool:
    """Files of a diffusers model checkpoint: what convert and save write and `overwrite` replaces."""
    return name == "config.json" or name.startswith("diffusion_pytorch_model")


def shard_bytes(max_shard_size: int | str) -> int:
    """`max_shard_size` in bytes, parsed as huggingface_hub parses it ("5GB" = 5e9, "60KB"); refused if not positive."""

    try:
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(str(max_shard_size))
    except ValueError as error:
        raise SurgeryError(f"max_shard_size {max_shard_size!r}: {error}") from None
    if size < 1:
        raise SurgeryError(f"max_shard_size {max_shard_size!r} is not positive: give a size such as '5GB'.")
    return size


@dataclass(frozen=True)
class Part:
    """Rows of one source tensor: `rows` of them (0 for a scalar); `read(rows)` gives those rows (`None`: all)."""

    rows: int
    read: Callable[[slice | None], torch.Tensor]


@dataclass(frozen=True)
class Entry:
    """One tensor to write: `name`, `dtype`, `shape`, and its values, the concatenation along `dim` of `parts`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    dim: int = 0

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def blocks(entry: Entry) -> Iterator[torch.Tensor]:
    """`entry`'s values as consecutive blocks of rows of at most about BLOCK_BYTES each (or one row)."""
    if not entry.shape or entry.nbytes == 0:
        pieces = [part.read(None) for part in entry.parts]
        yield torch.cat(pieces, entry.dim) if len(pieces) > 1 else pieces[0]
        return
    step = max(1, BLOCK_BYTES * entry.shape[0] // entry.nbytes)
    if entry.dim == 0:  # rows: the parts one after the other
        for part in entry.parts:
            for start in range(0, part.rows, step):
                yield part.read(slice(start, min(start + step, part.rows)))
        return
    for start in range(0, entry.shape[0], step):  # columns: the same rows of every part, side by side
        rows = slice(start, min(start + step, entry.shape[0]))
        pieces = [part.read(rows) for part in entry.parts]
        yield torch.cat(pieces, entry.dim) if len(pieces) > 1 else pieces[0]


def header(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    """safetensors' header for `entries` in this order: its length, then the JSON padded with spaces to 8 bytes."""
    fields: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for entry in entries:
        fields[entry.name] = {"dtype": _NAMES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    encoded = json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    return len(encoded).to_bytes(8, "little") + encoded


def write_chunk(out, chunk: torch.Tensor) -> None:
    """Write a tensor's bytes (no copy beyond making it contiguous)."""
    out.write(chunk.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_file(path: Path, entries: list[Entry], metadata: dict[str, str] | None) -> None:
    """One safetensors file holding `entries`, byte for byte what safetensors' `save_file` writes for them (ordered
    by dtype, widest first, then name), written block by block (the header first: the sizes are known) and fsynced.

    By hand because safetensors' writers take whole tensors (and `save_file` copies them into one buffer first). An
    OSError names `path`.
    """
    entries = sorted(entries, key=lambda e: (_RANK[e.dtype], e.name))
    try:
        with open(path, "wb") as out:
            out.write(header(entries, metadata))
            for entry in entries:
                written = 0
                for block in blocks(entry):
                    if block.dtype != entry.dtype:
                        raise SurgeryError(f"{entry.name}: read {block.dtype}, planned {entry.dtype} (a bug).")
                    write_chunk(out, block)
                    written += block.numel() * block.element_size()
                if written != entry.nbytes:
                    raise SurgeryError(f"{entry.name}: wrote {written} bytes, planned {entry.nbytes} (a bug).")
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        if error.filename is None:  # a failed write() names no file
            raise OSError(error.errno, error.strerror or str(error), str(path)) from error
        raise


def shard_plan(entries: list[Entry], max_shard_size: int | str, variant: str | None = None
               ) -> tuple[dict[str, list[Entry]], dict | None]:
    """diffusers' shard files and index for `entries` (in this order), from huggingface_hub's own splitter (the one
    diffusers' `save_pretrained` calls) on meta tensors.

    Returns file name -> entries, and the index to write (None when one file holds everything).
    """

    pattern = add_variant(WEIGHTS, variant).replace(".safetensors", "{suffix}.safetensors")  # as diffusers builds it
    metas = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
    split = split_torch_state_dict_into_shards(metas, max_shard_size=shard_bytes(max_shard_size),
                                               filename_pattern=pattern)
    by_name = {e.name: e for e in entries}
    files = {file: [by_name[name] for name in names] for file, names in split.filename_to_tensors.items()}
    if not split.is_sharded:
        return files, None
    return files, {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}


def write_checkpoint(folder: Path, entries: list[Entry], max_shard_size: int | str, variant: str | None = None,
                     metadata: dict[str, str] | None = None) -> None:
    """diffusers' weight files for `entries` in `folder`: the shards of `shard_plan`, each with `metadata` plus
    diffusers' `{"format": "pt"}`, and the index when there are several (written as `save_pretrained` writes it)."""
    files, index = shard_plan(entries, max_shard_size, variant)
    metadata = {**(metadata or {}), "format": "pt"}
    for file, planned in files.items():
        write_file(folder / file, planned, metadata)
    if index is not None:
        with open(folder / add_variant(INDEX, variant), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
