"""A GGUF checkpoint read a slice at a time: each rank reads only the byte ranges of its rows and block columns.

A GGUF tensor is stored row after row (GGML's `ne[0]` is the row length); a quantized row is whole blocks of
`block` columns, `block_bytes` bytes each. So rows `r0..r1`, columns `c0..c1` (block boundaries) are, per row, the
bytes `c0 / block * block_bytes .. c1 / block * block_bytes` from the row's start: one `pread` per run of consecutive
rows when the columns are whole rows, one per row otherwise. Names are mapped to the model's (fused) parameters with
diffusers' own single-file conversion, run on row numbers instead of weights (`row_sources`), so a fused q/k/v in
the file or a swapped shift/scale reads the very rows diffusers would have put there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

from surgery.core.errors import SurgeryError
from surgery.core.gguf import block_layout, type_name

_PLAIN = {0: np.float32, 1: np.float16}  # GGML F32, F16: what diffusers loads as plain tensors


@dataclass(frozen=True)
class StoredTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order: (rows, columns) or (elements,)
    offset: int  # of its first byte in the file

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in _PLAIN

    @property
    def row_bytes(self) -> int:
        columns = self.shape[-1] if len(self.shape) > 1 else 1
        return self.column_bytes(columns)

    def column_bytes(self, column: int) -> int:
        if not self.quantized:
            return column * np.dtype(_PLAIN[self.ggml_type]).itemsize
        block, block_bytes = block_layout(self.ggml_type)
        return column // block * block_bytes


class GGUFFile:
    """The tensors of one .gguf file (its header parsed by the `gguf` package) and reads of parts of them."""

    def __init__(self, path: str | os.PathLike):
        try:
            from gguf import GGUFReader  # optional: GGUF checkpoints only
        except ImportError as error:
            raise SurgeryError(f"'{path}' is a GGUF file; reading it needs the gguf package ({error}).") from None
        self.path = Path(path)
        try:
            reader = GGUFReader(self.path)  # maps the file; only its header is read here
        except Exception as error:  # noqa: BLE001 - the gguf package raises several kinds on a bad file
            raise SurgeryError(f"'{self.path}' is not a readable GGUF file ({error}).") from None
        self.tensors = {
            t.name: StoredTensor(t.name, int(t.tensor_type), tuple(int(n) for n in reversed(t.shape)),
                                 int(t.data_offset))
            for t in reader.tensors
        }
        del reader
        self._fd = os.open(self.path, os.O_RDONLY)

    def __enter__(self) -> "GGUFFile":
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
        quantized tensor, else its values. Columns of a quantized tensor must start and end on a block boundary."""
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
        data = np.frombuffer(b"".join(chunks), dtype=np.uint8 if t.quantized else _PLAIN[t.ggml_type])
        shape = (len(rows), (b - a) if t.quantized else stop - start) if len(t.shape) > 1 else (len(rows),)
        return torch.from_numpy(data.copy()).reshape(shape)


def row_sources(model: nn.Module, file: GGUFFile) -> dict[str, tuple[str, torch.Tensor]]:
    """For each of `model`'s (fused) parameters: (the file's tensor, which of its rows, in order). A file in diffusers'
    names maps as it is; one in the original layout goes through diffusers' single-file conversion for the model's
    class, applied to each tensor's row numbers."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    rows = {name: torch.arange(t.shape[0]) for name, t in file.tensors.items()}
    origin = {name: name for name in file.tensors}
    if not set(rows) <= set(expected):
        entry = SINGLE_FILE_LOADABLE_CLASSES.get(type(model).__name__)
        if entry is None:
            raise SurgeryError(
                f"load_tensor_parallel: '{file.path}' holds tensors diffusers does not name "
                f"({sorted(set(rows) - set(expected))[:3]}) and {type(model).__name__} has no single-file conversion."
            )
        # each row number tagged with its tensor (high bits), so the converted rows say where they came from
        names = list(file.tensors)
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
                f"load_tensor_parallel: '{file.path}': '{stored.name}' ({type_name(stored.ggml_type)}, shape "
                f"{stored.shape}) gives '{key}' shape {(len(index), *stored.shape[1:])}; the model expects "
                f"{expected[key]}."
            )
        out[key] = (origin[key], index)
    return out
