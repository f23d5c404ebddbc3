"""Single-file checkpoints read a slice at a time (GGUF; safetensors with fp8 weights and scales): each rank reads only
the byte ranges of its rows and (block) columns, with one `pread` each, so the bytes read are the bytes held.

A GGUF tensor is stored row after row (GGML's `ne[0]` is the row length); a quantized row is whole blocks of
`block` columns, `block_bytes` bytes each. So rows `r0..r1`, columns `c0..c1` (block boundaries) are, per row, the
bytes `c0 / block * block_bytes .. c1 / block * block_bytes` from the row's start: one `pread` per run of consecutive
rows when the columns are whole rows, one per row otherwise. Names are mapped to the model's (fused) parameters with
diffusers' own single-file conversion, run on row numbers instead of weights (`row_sources`), so a fused q/k/v in
the file or a swapped shift/scale reads the very rows diffusers would have put there.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

from surgery.core.errors import SurgeryError
from surgery.core.optional import need
from surgery.core.prequantized import block_layout, dequantizable, dequantizable_names
from surgery.parallel.agreement import file_identity

_GGML_PLAIN = {0: torch.float32, 1: torch.float16}  # GGML F32, F16: what diffusers loads as plain tensors
_SAFETENSORS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
                "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, columns) or (elements,)
    offset: int  # of its first byte in the file
    dtype: torch.dtype | None  # its values' dtype; None: GGUF-quantized bytes
    ggml_type: int | None = None

    @property
    def quantized(self) -> bool:
        """GGUF-quantized: its rows are blocks of bytes."""
        return self.dtype is None

    @property
    def row_bytes(self) -> int:
        columns = self.shape[-1] if len(self.shape) > 1 else 1
        return self.column_bytes(columns)

    def column_bytes(self, column: int) -> int:
        if not self.quantized:
            return column * self.dtype.itemsize
        block, block_bytes = block_layout(self.ggml_type)
        return column // block * block_bytes


class SlicedFile:
    """Reads of row/column parts of a file's tensors; `tensors` is filled by the format's reader."""

    path: Path
    tensors: dict[str, StoredTensor]

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY)

    def identity(self) -> str:
        """What the ranks compare, read from the open file after its tensors were (`file_identity`): every rank must
        have read the same file."""
        return file_identity(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise SurgeryError(f"'{self.path}': truncated at byte {offset + len(data)} (wanted {n} bytes there).")
        return data

    def read(self, name: str, rows: list[int], columns: slice | None) -> torch.Tensor:
        """Rows `rows` (in that order) and `columns` of tensor `name`: uint8 GGUF bytes (rows x bytes) for a
        GGUF-quantized tensor, else its values. Columns of a quantized tensor must start and end on a block
        boundary."""
        t = self.tensors[name]
        if len(t.shape) == 1:  # one element per row
            start, stop = 0, 1
        elif columns is None:
            start, stop = 0, t.shape[-1]
        else:
            start, stop = columns.start, columns.stop
        a, b = t.column_bytes(start), t.column_bytes(stop)
        whole_rows = a == 0 and b == t.row_bytes
        chunks, i = [], 0
        while i < len(rows):
            j = i + 1
            if whole_rows:  # a run of consecutive rows is one range of the file
                while j < len(rows) and rows[j] == rows[j - 1] + 1:
                    j += 1
            chunks.append(self._pread((j - i - 1) * t.row_bytes + (b - a), t.offset + rows[i] * t.row_bytes + a))
            i = j
        data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        if len(t.shape) == 1:
            return data.view(t.dtype) if t.dtype is not None else data
        data = data.reshape(len(rows), b - a)
        return data if t.quantized else data.view(t.dtype)


class SafetensorsFile(SlicedFile):
    """The tensors of one .safetensors file (its JSON header) and reads of parts of them."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                length = os.fstat(f.fileno()).st_size
                if size > length - 8:  # checked before reading: a corrupt size would allocate that much
                    raise SurgeryError(f"'{self.path}' is not a safetensors file: its first 8 bytes give a header of "
                                       f"{size} bytes, in a file of {length} bytes.")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as error:
            raise SurgeryError(f"'{self.path}' is not a readable safetensors file ({error}).") from None
        if not isinstance(header, dict):
            raise SurgeryError(f"'{self.path}': its header is not a JSON object of tensors but a "
                               f"{type(header).__name__}; not a safetensors file.")
        self.metadata = header.pop("__metadata__", None) or {}
        self.tensors = {}
        for name, entry in header.items():
            dtype, shape, offsets = _entry(self.path, name, entry)
            self.tensors[name] = StoredTensor(name, shape, 8 + size + offsets[0], dtype)
        _check_offsets(self.path, header, self.tensors, os.path.getsize(self.path) - 8 - size)
        self._open()


def _check_offsets(path: Path, header: dict, tensors: dict[str, StoredTensor], data_bytes: int) -> None:
    """What safetensors checks before it reads: the tensors' byte ranges tile the data section exactly, each as long
    as its shape times its dtype's size. A range moved or resized (a damaged or hand-edited header) would otherwise
    read another tensor's bytes as this one's values."""
    end = 0
    for name, entry in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, stop = entry["data_offsets"]
        t = tensors[name]
        expected = math.prod(t.shape) * t.dtype.itemsize
        if begin != end or stop - begin != expected:
            raise SurgeryError(
                f"'{path}': tensor {name!r} is stored at data bytes {begin}..{stop}, but its shape {list(t.shape)} of "
                f"{entry['dtype']} needs {expected} bytes starting at {end}, where the tensor before it ends: the header "
                "does not describe the data (a damaged or edited file). Write the file again (safetensors' "
                "save_file); stock safetensors refuses it as well."
            )
        end = stop
    if end != data_bytes:
        raise SurgeryError(
            f"'{path}': its header describes {end} bytes of tensor data, but the file holds {data_bytes} (a damaged "
            "or truncated file). Write the file again (safetensors' save_file)."
        )


def _entry(path: Path, name: str, entry) -> tuple[torch.dtype, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, data offsets) of one header entry, each checked for what safetensors writes there."""
    if not isinstance(entry, dict):
        raise SurgeryError(f"'{path}': the header's entry for {name!r} is {entry!r}, not an object with 'dtype', "
                           "'shape' and 'data_offsets'; not a safetensors file.")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise SurgeryError(f"'{path}': tensor {name!r} has no {key!r} in the header; not a safetensors file.")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise SurgeryError(f"'{path}': tensor {name!r} has shape {shape!r} in the header, not a list of sizes.")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int and n >= 0 for n in offsets):
        raise SurgeryError(f"'{path}': tensor {name!r} has data_offsets {offsets!r} in the header, not [begin, end].")
    dtype = _SAFETENSORS.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise SurgeryError(f"'{path}': tensor {name!r} has dtype {entry['dtype']!r}, which is not read here.")
    return dtype, tuple(shape), tuple(offsets)


class GGUFFile(SlicedFile):
    """The tensors of one .gguf file (its header parsed by the `gguf` package) and reads of parts of them."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        GGUFReader = need("gguf", f"'{path}', a GGUF file,").GGUFReader
        try:
            reader = GGUFReader(self.path)  # maps the file; only its header is read here
        except Exception as error:  # noqa: BLE001 - the gguf package raises several kinds on a bad file
            raise SurgeryError(f"'{self.path}' is not a readable GGUF file ({error}).") from None
        self.tensors = {
            t.name: StoredTensor(t.name, tuple(int(n) for n in reversed(t.shape)), int(t.data_offset),
                                 _GGML_PLAIN.get(int(t.tensor_type)), int(t.tensor_type))
            for t in reader.tensors
        }
        del reader
        for t in self.tensors.values():
            # refused here, not in the first forward (diffusers' dequantize raises a bare KeyError there)
            if t.quantized and not dequantizable(t.ggml_type):
                raise SurgeryError(
                    f"'{self.path}': tensor {t.name!r} is GGUF {_ggml_name(t.ggml_type)}, which diffusers cannot "
                    f"dequantize (it reads {', '.join(dequantizable_names())}). Convert the file to one of those "
                    "types (Q8_0 keeps the most).")
        self._open()


def _ggml_name(ggml_type: int) -> str:
    try:
        return f"{need('gguf', 'a GGUF type name').GGMLQuantizationType(ggml_type).name} (type {ggml_type})"
    except ValueError:
        return f"type {ggml_type}"


def row_sources(model: nn.Module, file: SlicedFile, names: list[str] | None = None
                ) -> dict[str, tuple[str, torch.Tensor]]:
    """For each of `model`'s (fused) parameters: (the file's tensor, which of its rows, in order). A file in diffusers'
    names maps as it is; one in the original layout goes through diffusers' single-file conversion for the model's
    class, applied to each tensor's row numbers."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    names = list(file.tensors) if names is None else names
    rows = {name: torch.arange(file.tensors[name].shape[0]) for name in names}
    origin = {name: name for name in names}
    if not set(rows) <= set(expected):
        entry = SINGLE_FILE_LOADABLE_CLASSES.get(type(model).__name__)
        if entry is None:
            raise SurgeryError(
                f"load_tensor_parallel: '{file.path}' holds tensors diffusers does not name "
                f"({sorted(set(rows) - set(expected))[:3]}) and {type(model).__name__} has no single-file conversion."
            )
        # each row number tagged with its tensor (high bits), so the converted rows say where they came from
        tagged = {name: rows[name] + (index << 32) for index, name in enumerate(names)}
        converted = entry["checkpoint_mapping_fn"](config=model.config, checkpoint=dict(tagged))
        rows = {}
        for key, value in converted.items():
            sources = {int(v) >> 32 for v in value.reshape(-1)}
            if value.ndim != 1 or len(sources) != 1:
                raise SurgeryError(
                    f"load_tensor_parallel: diffusers' conversion builds '{key}' from more than the rows of one "
                    f"tensor of '{file.path}'; per-rank GGUF reading reads rows. Load it with from_single_file."
                )
            origin[key] = names[sources.pop()]
            rows[key] = value & ((1 << 32) - 1)
    missing = sorted(set(expected) - set(rows))
    extra = sorted(set(rows) - set(expected))
    if missing or extra:
        raise SurgeryError(
            f"load_tensor_parallel: '{file.path}' does not match {type(model).__name__}'s config: missing "
            f"{missing[:3]}, unexpected {extra[:3]}."
        )
    out = {}
    for key, index in rows.items():
        stored = file.tensors[origin[key]]
        if (len(index), *stored.shape[1:]) != expected[key]:
            raise SurgeryError(
                f"load_tensor_parallel: '{file.path}': '{stored.name}' (shape "
                f"{stored.shape}) gives '{key}' shape {(len(index), *stored.shape[1:])}; the model expects "
                f"{expected[key]}."
            )
        out[key] = (origin[key], index)
    return out
