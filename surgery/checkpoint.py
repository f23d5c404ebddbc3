"""diffusers-format safetensors checkpoints: find the files, read headers and slices, write tensor by tensor.

`convert_checkpoint` turns a fused diffusers checkpoint into the unfused layout and back, streaming: it holds about
one tensor in memory at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
from safetensors import safe_open

from .checks import SurgeryError
from .slicing import Slice, fused_shape, group_by_fused

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def resolve_checkpoint(checkpoint: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding the model's `config.json` and weights.

    Accepts a model folder, a pipeline folder (its `transformer/` is used), or a Hugging Face repo id whose files are
    already in the local cache (nothing is downloaded).
    """
    path = Path(checkpoint)
    if not path.exists():
        if str(checkpoint).count("/") != 1:
            raise SurgeryError(f"checkpoint {str(checkpoint)!r} is neither a local path nor a repo id 'org/name'.")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            path = Path(snapshot_download(str(checkpoint), cache_dir=cache_dir, local_files_only=True))
        except LocalEntryNotFoundError:
            raise SurgeryError(
                f"{checkpoint!r} is not in the local Hugging Face cache. Download it first "
                f"(`huggingface-cli download {checkpoint}`) or pass a local path."
            ) from None
    if path.is_file():
        return path.parent
    if not (path / "config.json").exists() and (path / "transformer" / "config.json").exists():
        path = path / "transformer"
    if not (path / "config.json").exists():
        raise SurgeryError(f"'{path}' has no config.json: pass a diffusers model folder or a pipeline folder.")
    return path


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when sharded."""
    if (folder / INDEX).exists():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        raise SurgeryError(
            f"'{folder}' holds no safetensors weights{f' (found {others})' if others else ''}. Each rank reads only "
            "its own slice of each tensor, which needs safetensors: re-save with `save_pretrained(..., "
            "safe_serialization=True)`."
        )
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            names.update({name: file for name in f.keys()})
    return names


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


class Reader:
    """Opens each safetensors file once; reads whole tensors or slices of them (only those bytes)."""

    def __init__(self, folder: Path):
        self.files = weight_files(folder)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, "pt"))
        return self._handles[file]

    def info(self, name: str) -> TensorInfo:
        piece = self._handle(name).get_slice(name)
        return TensorInfo(piece.get_dtype(), tuple(piece.get_shape()))

    def metadata(self) -> dict[str, str]:
        if not self.files:
            return {}
        return self._handle(next(iter(self.files))).metadata() or {}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        piece = self._handle(name).get_slice(name)
        return piece[index] if index else piece[:]


def model_on_meta(folder: Path, model_class: type | None = None) -> nn.Module:
    """The checkpoint's model built on the meta device from its config.json (class from `_class_name`)."""
    import diffusers

    config = json.loads((folder / "config.json").read_text())
    if model_class is None:
        name = config.get("_class_name")
        model_class = getattr(diffusers, name, None) if name else None
        if model_class is None:
            raise SurgeryError(f"'{folder}/config.json' names no diffusers class ({name!r}); pass model_class.")
    with torch.device("meta"):
        return model_class.from_config(model_class.load_config(folder))


def _safetensors_dtype(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value == dtype)


def write_streaming(path: Path, entries: list[tuple[str, TensorInfo, Callable[[], torch.Tensor]]],
                    metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file whose tensors are produced one at a time by `entries` (name, info, producer)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, info, _ in entries:
        size = torch.Size(info.shape).numel() * torch.empty((), dtype=_DTYPES[info.dtype]).element_size()
        header[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for name, info, produce in entries:
            tensor = produce()
            if _safetensors_dtype(tensor.dtype) != info.dtype or tuple(tensor.shape) != info.shape:
                raise RuntimeError(f"{name}: produced {tensor.dtype} {tuple(tensor.shape)}, declared {info}")
            out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def layout_of(keys: set[str], slices: list[Slice]) -> str:
    """'fused' or 'unfused': which side of `slices` the checkpoint's keys are on."""
    if all(s.fused in keys for s in slices):
        return "fused"
    if all(s.unfused in keys for s in slices):
        return "unfused"
    missing = sorted({s.fused for s in slices} - keys)
    raise SurgeryError(
        f"the checkpoint has neither the fused nor the unfused layout of this model: it lacks {len(missing)} fused "
        f"key(s), first {missing[0]!r}. Is it a checkpoint of this model class and config?"
    )


def _index(ndim: int, dim: int, start: int, stop: int) -> tuple[slice, ...]:
    index = [slice(None)] * ndim
    index[dim] = slice(start, stop)
    return tuple(index)


def _converted(reader: Reader, slices: list[Slice], to: str) -> Iterator[tuple[str, TensorInfo, Callable]]:
    """(name, info, producer) of every tensor of the other layout, in the checkpoint's order."""
    by_fused = dict(group_by_fused(slices))
    by_unfused = {s.unfused: s for s in slices}
    emitted: set[str] = set()
    for name in reader.files:
        if to == "unfused" and name in by_fused:
            info = reader.info(name)
            for s in by_fused[name]:
                index = _index(len(info.shape), s.dim, s.start, s.stop)
                yield s.unfused, TensorInfo(info.dtype, s.unfused_shape(info.shape)), (
                    lambda n=name, i=index: reader.read(n, i)
                )
        elif to == "fused" and name in by_unfused:
            group = by_fused[by_unfused[name].fused]
            if group[0].fused in emitted:
                continue
            emitted.add(group[0].fused)
            first = reader.info(group[0].unfused)
            parts = [s.unfused for s in group]
            yield group[0].fused, TensorInfo(first.dtype, fused_shape(first.shape, group)), (
                lambda parts=parts, dim=group[0].dim: torch.cat([reader.read(p) for p in parts], dim=dim)
            )
        else:
            yield name, reader.info(name), (lambda name=name: reader.read(name))


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str = "unfused",
                       cache_dir: str | os.PathLike | None = None) -> Path:
    """Write `src` (a diffusers model folder) into `dst` in the `to` layout ("unfused" or "fused"), tensor by tensor.

    `dst` gets the same config.json and one `diffusion_pytorch_model.safetensors`. Fused -> unfused -> fused is
    bitwise. Returns `dst`.
    """
    from .state_dict import key_map

    if to not in ("unfused", "fused"):
        raise SurgeryError(f"surgery.convert: to={to!r}; use 'unfused' or 'fused'.")
    folder = resolve_checkpoint(src, cache_dir)
    slices = key_map(model_on_meta(folder))
    dst = Path(dst)
    with Reader(folder) as reader:
        layout = layout_of(set(reader.files), slices)
        if layout == to:
            raise SurgeryError(f"surgery.convert: '{folder}' is already in the {to} layout.")
        entries = list(_converted(reader, slices, to))
        dst.mkdir(parents=True, exist_ok=True)
        write_streaming(dst / WEIGHTS, entries, reader.metadata())
    shutil.copy(folder / "config.json", dst / "config.json")
    return dst
