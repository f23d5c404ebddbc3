"""diffusers-format safetensors checkpoints: find the files, check them against the model, read slices, convert.

Files are picked as diffusers' `from_pretrained` picks them: the index if present, else the canonical file name;
variants (`diffusion_pytorch_model.fp16.safetensors`) only when asked for; other files are ignored. Every tensor's
dtype and shape is checked against the model built from `config.json` before anything is read or written, and
every error names the file.

`convert_checkpoint` turns a fused diffusers checkpoint into the unfused layout and back, streaming (a few row
blocks in memory at a time), into diffusers' sharded layout (`surgery.io.safetensors_writer`, the writer
`save_pretrained` uses too), atomically (`surgery.io.atomic`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id
import diffusers

from surgery.core.build import published_processor
from surgery.core.errors import SurgeryError
from surgery.core.optional import need
from surgery.core.rewrite import unfuse
from surgery.core.slicing import Slice, fused_shape, group_by_fused
from surgery.core.state_dict import weight_slices
from surgery.io.atomic import destination, staged_folder
from surgery.parallel.agreement import file_identity
from surgery.io.safetensors_writer import (
    DEFAULT_MAX_SHARD_SIZE, DTYPES, INDEX, WEIGHTS, Entry, Part, add_variant, owns, shard_bytes, write_checkpoint,
)

TRANSFORMERS_WEIGHTS, TRANSFORMERS_INDEX = "model.safetensors", "model.safetensors.index.json"  # text encoders


def _is_repo_id(text: str) -> bool:
    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(checkpoint: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding the model's `config.json` and weights.

    Accepts a model folder, a pipeline folder (its `transformer/` is used), or a Hugging Face repo id 'org/name'
    whose files are already in the local cache (nothing is downloaded).
    """
    path = Path(checkpoint)
    if not path.exists():
        if not _is_repo_id(str(checkpoint)):
            raise SurgeryError(f"'{checkpoint}' does not exist (and is not a Hugging Face repo id 'org/name').")

        try:
            path = Path(snapshot_download(str(checkpoint), cache_dir=cache_dir, local_files_only=True))
        except LocalEntryNotFoundError:
            raise SurgeryError(
                f"'{checkpoint}' does not exist locally and is not in the local Hugging Face cache. Download it first "
                f"(`huggingface-cli download {checkpoint}`) or pass a local path."
            ) from None
    if path.is_file():
        return path.parent
    if not (path / "config.json").exists() and (path / "transformer" / "config.json").exists():
        path = path / "transformer"
    if not (path / "config.json").exists():
        raise SurgeryError(f"'{path}' has no config.json: pass a diffusers model folder or a pipeline folder.")
    return path


def _open(file: Path):
    try:
        return safe_open(file, "pt")
    except (SafetensorError, OSError) as error:
        raise SurgeryError(f"'{file}' is not a readable safetensors file ({error}): truncated or corrupt? "
                           "Download or save it again.") from None


def _index_files(folder: Path, index: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from a diffusers index (checked as diffusers checks it, plus the keys)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (ValueError, KeyError, TypeError) as error:
        raise SurgeryError(f"'{index}' is not a valid checkpoint index ({type(error).__name__}: {error}).") from None
    for file in sorted(set(weight_map.values())):
        if os.path.basename(file) != file:
            raise SurgeryError(f"'{index}' names shard {file!r}, which is not a plain file name in '{folder}'.")
        if not (folder / file).is_file():
            raise SurgeryError(f"'{index}' names shard '{folder / file}', which does not exist.")
    files = {name: folder / file for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
        with _open(file) as handle:
            present = set(handle.keys())
        absent = sorted(name for name, f in files.items() if f == file and name not in present)
        if absent:
            raise SurgeryError(f"'{file}' lacks {len(absent)} tensor(s) that '{index.name}' places there, first "
                               f"{absent[0]!r}: the index and its shards are out of step. Save the checkpoint again.")
    return files


def _refuse_missing(folder: Path, variant: str | None) -> None:
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt",
                                                                       ".gguf"))
    wanted = f"{add_variant(INDEX, variant)} nor {add_variant(WEIGHTS, variant)}"
    if not any(name.endswith(".safetensors") for name in others):
        found = f" (found {others})" if others else ""
        raise SurgeryError(
            f"'{folder}' holds no safetensors weights{found}: neither {wanted}. Each rank reads only its own slice "
            "of each tensor, which needs safetensors: re-save with `save_pretrained(..., safe_serialization=True)`."
        )
    variants = sorted({m[1] for name in others if (m := re.fullmatch(r"diffusion_pytorch_model\.(\w+)\.safetensors"
                                                                      r"(?:\.index\.json)?", name))})
    hint = f" For a variant pass variant={variants[0]!r} (--variant {variants[0]})." if variants else (
        " Other files are not read (as in diffusers): rename the one you mean to the canonical name.")
    raise SurgeryError(f"'{folder}' has neither {wanted}; it holds {others}.{hint}")


def weight_files(folder: Path, variant: str | None = None) -> dict[str, Path]:
    """Tensor name -> safetensors file, picked as diffusers does: the (variant's) index if present, else the
    (variant's) canonical file. Other files are ignored. A transformers model's folder (a pipeline's
    `text_encoder/`: `model.safetensors`, or sharded with `model.safetensors.index.json`) is read the same way."""
    if variant is None and not (folder / INDEX).is_file() and not (folder / WEIGHTS).is_file():
        if (folder / TRANSFORMERS_INDEX).is_file():
            return _index_files(folder, folder / TRANSFORMERS_INDEX)
        if (folder / TRANSFORMERS_WEIGHTS).is_file():
            with _open(folder / TRANSFORMERS_WEIGHTS) as handle:
                return {name: folder / TRANSFORMERS_WEIGHTS for name in handle.keys()}
    for index in (folder / add_variant(INDEX, variant), folder / f"{WEIGHTS}.{variant}.index.json"):
        if index.is_file():  # the second is diffusers' legacy variant index name
            return _index_files(folder, index)
        if variant is None:
            break
    file = folder / add_variant(WEIGHTS, variant)
    if not file.is_file():
        _refuse_missing(folder, variant)
    with _open(file) as handle:
        return {name: file for name in handle.keys()}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.torch_dtype).element_size()


class Reader:
    """Opens each safetensors file once; reads whole tensors or slices of them (only those bytes)."""

    def __init__(self, folder: Path, variant: str | None = None):
        self.folder = folder
        self.files = weight_files(folder, variant)
        self.stored: dict[str, str] = {}  # name -> the name stored in the file, where `rename` changed it
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self.identities: dict[str, str] = {}  # each file opened, by its path in the folder: `file_identity`

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def rename(self, names: dict[str, str]) -> None:
        """Read stored tensor `old` as `names[old]` (a transformers checkpoint's legacy names, for one)."""
        self.files = {names.get(name, name): file for name, file in self.files.items()}
        self.stored = {new: old for old, new in names.items() if new != old}

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open(file))
            fd = os.open(file, os.O_RDONLY)
            try:
                self.identities[os.path.relpath(file, self.folder)] = file_identity(fd)
            finally:
                os.close(fd)
        return self._handles[file]

    def info(self, name: str) -> TensorInfo:
        piece = self._handle(name).get_slice(self.stored.get(name, name))
        return TensorInfo(piece.get_dtype(), tuple(piece.get_shape()))

    def metadata(self) -> dict[str, str]:
        if not self.files:
            return {}
        return self._handle(next(iter(self.files))).metadata() or {}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        try:
            handle, stored = self._handle(name), self.stored.get(name, name)
            return handle.get_slice(stored)[index] if index else handle.get_tensor(stored)
        except SafetensorError as error:
            raise SurgeryError(f"'{self.files[name]}': cannot read tensor {name!r} ({error}).") from None


def model_on_meta(folder: Path, model_class: type | None = None) -> nn.Module:
    """The checkpoint's model built on the meta device from its config.json (class from `_class_name`)."""

    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as error:
        raise SurgeryError(f"'{folder / 'config.json'}' is not valid JSON ({error}).") from None
    if isinstance(config, dict) and "_class_name" not in config and "model_type" in config:
        # a transformers model (a pipeline's text encoder)
        return _transformers_on_meta(folder, config, model_class)
    name = config.get("_class_name") if isinstance(config, dict) else None
    given = model_class is not None
    if not given:
        model_class = getattr(diffusers, name, None) if isinstance(name, str) and name else None
    if not (isinstance(model_class, type) and issubclass(model_class, diffusers.ModelMixin)):
        what = ("a pipeline class, not a model" if isinstance(model_class, type)
                and issubclass(model_class, diffusers.DiffusionPipeline) else "no diffusers model class")
        said = f"the class given, {model_class!r}," if given else f"'{folder}/config.json' names _class_name {name!r},"
        raise SurgeryError(f"{said} which is {what}. Pass a diffusers model folder (its config.json names e.g. "
                           "Flux2Transformer2DModel, as a pipeline's transformer/ does), or the model class itself.")

    try:
        with init_empty_weights():
            return published_processor(model_class.from_config(model_class.load_config(folder)))
    except (TypeError, ValueError, AssertionError, ZeroDivisionError) as error:
        raise SurgeryError(f"'{folder / 'config.json'}' does not build a {model_class.__name__}: {error}") from None


def _transformers_on_meta(folder: Path, config: dict, model_class: type | None) -> nn.Module:
    """A transformers model built on meta from its folder's config.json (class from `architectures`)."""
    transformers = need("transformers", f"'{folder}', a transformers model's folder,")

    if model_class is None:
        names = config.get("architectures") or []
        model_class = getattr(transformers, names[0], None) if names else None
        if model_class is None:
            raise SurgeryError(f"'{folder}/config.json' names no transformers class ({names!r}); pass model_class.")
    try:
        loaded = transformers.AutoConfig.from_pretrained(folder)
        with init_empty_weights():
            model = model_class(loaded)
        model.tie_weights()  # as from_pretrained does: on meta the tied embeddings come out untied
        return model
    except (TypeError, ValueError, AttributeError) as error:
        raise SurgeryError(f"'{folder / 'config.json'}' does not build a {model_class.__name__}: {error}") from None


# ---- checks: one place for the loader and the converter ------------------------------------------------------------

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


Spec = tuple[tuple[int, ...], torch.dtype]  # shape, dtype


def expected_tensors(model: nn.Module, slices: list[Slice], layout: str) -> dict[str, Spec]:
    """Checkpoint key -> (shape, dtype) that a `layout` checkpoint of the unfused `model` (on meta) must hold."""
    tensors = dict(model.named_parameters())  # not state_dict(): its hooks may give the fused layout already
    for owner, module in model.named_modules():
        tensors.update({f"{owner}.{n}".lstrip("."): b for n, b in module.named_buffers(recurse=False)
                        if n not in module._non_persistent_buffers_set})
    specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    if layout == "unfused":
        return specs
    parts = {s.unfused for s in slices}  # removed first: a fused name may equal an unfused one (`to_out`)
    fused = {name: spec for name, spec in specs.items() if name not in parts}
    for name, group in group_by_fused(slices):
        shape, dtype = specs[group[0].unfused]
        fused[name] = (fused_shape(shape, group), dtype)
    return fused


def check_tensors(reader: Reader, expected: dict[str, Spec], *,
                  mixed_dtypes: bool, siblings: list[list[str]] = ()) -> dict[str, TensorInfo]:
    """Every tensor of `reader` against `expected`: names, shapes, floating or not, and dtypes that agree.

    `mixed_dtypes`: whether tensors may differ in dtype (the loader casts them to an explicit `dtype=`); tensors in
    one `siblings` group (the parts of one fused tensor) must always agree.
    """
    folder = reader.folder
    present = set(reader.files)
    missing = sorted(set(expected) - present)
    if missing:
        raise SurgeryError(f"'{folder}' lacks {len(missing)} tensor(s) the model needs, first {missing[0]!r}.")
    extra = sorted(present - set(expected))
    if extra:
        raise SurgeryError(
            f"'{folder}' holds {len(extra)} tensor(s) the model has no place for, first {extra[0]!r} (in "
            f"'{reader.files[extra[0]].name}'): a checkpoint of another model or config?"
        )
    infos = {name: reader.info(name) for name in sorted(expected)}
    for name, (shape, dtype) in sorted(expected.items()):
        info, file = infos[name], reader.files[name]
        if info.shape != shape:
            raise SurgeryError(
                f"'{file}': tensor {name!r} has shape {info.shape}, the model needs {shape}. "
                "Does config.json match the weights?"
            )
        if info.dtype not in DTYPES:
            raise SurgeryError(f"'{file}': tensor {name!r} has dtype {info.dtype}, which surgery cannot read.")
        if dtype.is_floating_point and not info.torch_dtype.is_floating_point:
            raise SurgeryError(
                f"'{file}': tensor {name!r} is {info.torch_dtype}, the model's is floating point ({dtype}). "
                "Casting would not give its weights back: is this the right checkpoint?"
            )
    groups = list(siblings) if mixed_dtypes else [sorted(expected)]
    for group in groups:
        counts = Counter(infos[name].dtype for name in group)
        if len(counts) > 1:
            common = counts.most_common(1)[0][0]
            odd = next(name for name in group if infos[name].dtype != common)
            other = next(name for name in group if infos[name].dtype == common)
            what = "its sibling parts are" if mixed_dtypes else f"{counts[common]} other tensors are"
            fix = "save the parts in one dtype" if mixed_dtypes else "pass dtype= to cast every tensor to one dtype"
            raise SurgeryError(
                f"'{reader.files[odd]}': tensor {odd!r} is {infos[odd].torch_dtype} while {what} "
                f"{DTYPES[common]} (e.g. {other!r} in '{reader.files[other].name}'): {fix}."
            )
    return infos


# ---- convert --------------------------------------------------------------------------------------------------------

def _holds_checkpoint(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if owns(p.name) or p.name.endswith(".safetensors"))


def _destination(dst: str | os.PathLike, source: Path, overwrite: bool) -> Path:
    """The resolved destination, refused when it is or holds the source, is a file or a pipeline's root folder, or
    holds a checkpoint."""

    target = Path(dst).resolve()
    src = source.resolve()

    def same(a: Path, b: Path) -> bool:
        return a == b or (a.exists() and b.exists() and os.path.samefile(a, b))

    if any(same(p, src) for p in (target, *target.parents)):
        raise SurgeryError(f"destination '{dst}' is, or lies inside, the source '{source}': write somewhere else "
                           "(a conversion never writes where it reads).")
    if target.exists() and any(same(target, p) for p in src.parents):
        raise SurgeryError(f"destination '{dst}' holds the source '{source}': replacing it would replace the "
                           "source. Write somewhere else.")
    destination(dst, "surgery.convert")  # a file, a pipeline's root folder
    if target.is_dir() and not overwrite:
        found = _holds_checkpoint(target)
        if found:
            raise SurgeryError(
                f"destination '{dst}' already holds a checkpoint ({', '.join(found[:4])}"
                f"{', ...' if len(found) > 4 else ''}): pass overwrite=True (--overwrite) to replace it, or choose "
                "another folder."
            )
    return target


def _part(reader: Reader, name: str, shape: tuple[int, ...], index: tuple[slice, ...] | None) -> Part:
    """The rows of stored tensor `name` (of `shape`) that `index` selects (all of it for None), read as asked."""
    rows = (len(range(shape[0])[index[0]]) if index else shape[0]) if shape else 0

    def read(block: slice | None) -> torch.Tensor:
        if block is None:
            return reader.read(name, index)
        narrowed = list(index or (slice(None),) * len(shape))
        base = narrowed[0].start or 0
        narrowed[0] = slice(base + block.start, base + block.stop)
        return reader.read(name, tuple(narrowed))

    return Part(rows, read)


def _plan(reader: Reader, infos: dict[str, TensorInfo], slices: list[Slice], to: str) -> list[Entry]:
    """Every tensor of the other layout, in the checkpoint's order."""
    by_fused = dict(group_by_fused(slices))
    by_unfused = {s.unfused: s for s in slices}
    planned: list[Entry] = []
    emitted: set[str] = set()
    for name in reader.files:
        info = infos[name]
        if to == "unfused" and name in by_fused:
            for s in by_fused[name]:
                index = [slice(None)] * len(info.shape)
                index[s.dim] = slice(s.start, s.stop)
                planned.append(Entry(s.unfused, info.torch_dtype, s.unfused_shape(info.shape),
                                     (_part(reader, name, info.shape, tuple(index)),)))
        elif to == "fused" and name in by_unfused:
            group = by_fused[by_unfused[name].fused]
            if group[0].fused not in emitted:
                emitted.add(group[0].fused)
                shape = fused_shape(infos[group[0].unfused].shape, group)
                parts = tuple(_part(reader, s.unfused, infos[s.unfused].shape, None) for s in group)
                planned.append(Entry(group[0].fused, info.torch_dtype, shape, parts, group[0].dim))
        else:
            planned.append(Entry(name, info.torch_dtype, info.shape, (_part(reader, name, info.shape, None),)))
    return planned


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str = "unfused", *,
                       overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                       variant: str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write `src` (a diffusers model folder) into `dst` in the `to` layout ("unfused" or "fused"), block by block.

    `dst` gets the same config.json and diffusers' layout: one `diffusion_pytorch_model.safetensors`, or shards of
    at most `max_shard_size` (diffusers' default, "10GB") named and indexed as `save_pretrained` names them.
    `variant` reads (and writes) `diffusion_pytorch_model.<variant>.safetensors`. Every tensor is checked against the
    model built from config.json before anything is written; the output is written into a temporary sibling and
    swapped into place when complete. A `dst` that is or lies inside `src` is refused; a `dst` holding another
    checkpoint is refused unless `overwrite=True`, which replaces that checkpoint whole (other files stay).
    Fused -> unfused -> fused is bitwise. Returns `dst` (resolved).
    """

    if to not in ("unfused", "fused"):
        raise SurgeryError(f"surgery.state_dict.convert_checkpoint: to={to!r}; use 'unfused' or 'fused'.")
    shard_bytes(max_shard_size)
    folder = resolve_checkpoint(src, cache_dir)
    target = _destination(dst, folder, overwrite)
    model = unfuse(model_on_meta(folder))
    slices = weight_slices(model)
    if not slices:
        raise SurgeryError(f"'{folder}' holds a {type(model).__name__} checkpoint, which has no fused modules that "
                           "surgery rewrites: nothing to convert.")
    with Reader(folder, variant) as reader:
        layout = layout_of(set(reader.files), slices)
        if layout == to:
            raise SurgeryError(f"'{folder}' is already in the {to} layout.")
        siblings = [[s.unfused for s in group] for _, group in group_by_fused(slices)] if layout == "unfused" else []
        infos = check_tensors(reader, expected_tensors(model, slices, layout), mixed_dtypes=True, siblings=siblings)
        planned = _plan(reader, infos, slices, to)
        with staged_folder(target, owns, "surgery.convert") as staged:
            write_checkpoint(staged, planned, max_shard_size, variant, reader.metadata())
            shutil.copyfile(folder / "config.json", staged / "config.json")
    return target
