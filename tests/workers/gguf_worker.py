"""What each gloo rank runs for the GGUF tests: a GGUF FLUX.2 checkpoint loaded whole by diffusers, unfused and
sharded by `tensor_parallel`, against the same GGUF model run whole on one process."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

warnings.filterwarnings("ignore")

import surgery  # noqa: E402
from surgery.core.prequantized import GGUFWeight  # noqa: E402
from surgery.io import sliced_files  # noqa: E402
from surgery.parallel.quantized import held_bytes  # noqa: E402
from surgery.testing import rel_err  # noqa: E402
from surgery_rewrites.flux2 import FAMILY, example_inputs  # noqa: E402
from gguf_testing import GGUF_CONFIG, load_fp8, load_gguf  # noqa: E402

KINDS = ("Q8_0", "Q4_0", "Q4_K")


def _forward(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def expected_bytes(whole, sharded, world: int) -> int:
    """What a rank should hold: each cut tensor's bytes (GGUF bytes of a GGUF weight) over `world`, the rest whole."""
    total = 0
    for name, param in whole.named_parameters():
        mine = sharded.get_parameter(name)
        stored = param.qdata if isinstance(param, GGUFWeight) else param
        held = mine.qdata if isinstance(mine, GGUFWeight) else mine
        cut = isinstance(held, DTensor) and held.placements[0].is_shard()
        total += stored.nbytes // world if cut else stored.nbytes
    return total + sum(b.nbytes for b in whole.buffers())


def gguf_bytes(model) -> int:
    """The GGUF bytes this rank holds (its cut of each quantized weight)."""
    return sum(_local(p).nbytes for p in model.parameters() if isinstance(p, GGUFWeight))


def run(rank: int, world: int, folder: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    kw = example_inputs(GGUF_CONFIG, batch=2, image_tokens=10, text_tokens=6, seed=0)
    result = {}
    for kind in KINDS:
        path = Path(folder) / kind / "model.gguf"
        stock = load_gguf(path)  # diffusers' GGUFLinears, run whole: the reference
        expected = _forward(stock, kw)
        row = {"whole_vs_float": rel_err(expected, _forward(load_gguf(Path(folder) / "F32" / "model.gguf"), kw))}
        unfused = surgery.unfuse(load_gguf(path))
        row["unfused"] = rel_err(_forward(unfused, kw), expected)
        row["whole_bytes"] = held_bytes(unfused)
        whole = copy.deepcopy(unfused)
        surgery.tensor_parallel(unfused, mesh)
        row["tp"] = rel_err(_forward(unfused, kw), expected)
        row["tp_bytes"] = held_bytes(unfused)
        row["tp_expected_bytes"] = expected_bytes(whole, unfused, world)
        row["whole_gguf_bytes"] = gguf_bytes(whole)
        row["tp_gguf_bytes"] = gguf_bytes(unfused)
        row["tp_sharded_gguf"] = sum(isinstance(p, GGUFWeight) and isinstance(p.qdata, DTensor)
                                     and p.qdata.placements[0].is_shard() for p in unfused.parameters())
        loaded, read = _load_counting_reads(path, mesh)
        row["loaded"] = rel_err(_forward(loaded, kw), expected)
        row["loaded_bytes"] = held_bytes(loaded)
        row["loaded_read"] = read
        row["loaded_same_as_tp"] = _same_local(loaded, unfused)
        row["file_bytes"] = path.stat().st_size
        row["gguf_weights"] = sum(isinstance(p, GGUFWeight) for p in loaded.parameters())
        result[kind] = row
    from surgery.sight.report import quantized_plan

    planned = quantized_plan(dict(GGUF_CONFIG), [world], "q4", family=FAMILY, dtype=torch.float32)
    result["Q4_K"]["planned_bytes"] = planned["rows"][0]["bytes_per_rank"]
    result["fp8"] = fp8(Path(folder) / "fp8" / "model.safetensors", mesh, kw)
    return result


def fp8(path: Path, mesh, kw) -> dict:
    """BFL's fp8r single file: diffusers' `BFLFP8RLinear` model run whole vs each rank's torchao Float8 shards."""
    from diffusers.quantizers.bfl.utils import BFLFP8RLinear

    stock = load_fp8(path)
    expected = _forward(stock, kw)
    row = {"whole_vs_float": rel_err(expected, _forward(load_gguf(path.parent.parent / "F32" / "model.gguf"), kw))}
    fp8_linears = [(path, m) for path, m in stock.named_modules() if isinstance(m, BFLFP8RLinear)]
    row["whole_fp8_bytes"] = sum(m.weight.nbytes for _, m in fp8_linears)
    # the blocks' Linears are cut (their fp8 values halve), the others (modulation, embedders) stay whole
    row["expected_fp8_bytes"] = sum(m.weight.nbytes // (mesh.size() if "transformer_blocks." in path else 1)
                                    for path, m in fp8_linears)
    unfused = surgery.unfuse(load_fp8(path))
    row["unfused"] = rel_err(_forward(unfused, kw), expected)
    surgery.tensor_parallel(unfused, mesh)
    row["tp"] = rel_err(_forward(unfused, kw), expected)
    row["tp_bytes"] = held_bytes(unfused)
    loaded, read = _load_counting_reads(path, mesh)
    row["loaded"] = rel_err(_forward(loaded, kw), expected)
    row["loaded_bytes"] = held_bytes(loaded)
    row["loaded_same_as_tp"] = _same_local(loaded, unfused)
    row["loaded_read"] = read
    row["file_bytes"] = path.stat().st_size
    float8 = [p for p in loaded.parameters() if type(p).__name__ == "Float8Tensor"]
    row["float8_weights"] = len(float8)
    row["fp8_bytes"] = sum(_local(p.qdata).nbytes for p in float8)
    row["sharded_fp8"] = sum(isinstance(p.qdata, DTensor) and p.qdata.placements[0].is_shard() for p in float8)
    return row


def _load_counting_reads(path: Path, mesh):
    """`load_tensor_parallel` of the .gguf file, with every byte it reads from the file counted (os.pread: how the
    GGUF path reads tensor data; the header is parsed from a map before)."""
    counted = [0]
    real, identity = os.pread, sliced_files.file_identity
    comparing = [False]

    def pread(fd, n, offset):
        data = real(fd, n, offset)
        counted[0] += 0 if comparing[0] else len(data)
        return data

    def file_identity(fd):
        # the fixed-size digest the ranks compare (a header and samples), not tensor data: counted apart
        comparing[0] = True
        try:
            return identity(fd)
        finally:
            comparing[0] = False

    os.pread = pread
    try:
        with mock.patch.object(sliced_files, "file_identity", file_identity):
            model = surgery.load_tensor_parallel(None, path, mesh, progress=False)
    finally:
        os.pread = real
    return model, counted[0]


def _local(t):
    t = t.qdata if isinstance(t, GGUFWeight) else t
    return t.to_local() if isinstance(t, DTensor) else t


def _locals(t) -> list:
    """A parameter's local tensors: its shard, or a quantized weight's inner shards (bytes compared as such)."""
    if type(t).__name__ == "Float8Tensor":
        return [_local(t.qdata).view(torch.uint8), _local(t.scale)]
    return [_local(t)]


def _same_local(a, b) -> bool:
    """The two sharded models hold the same local tensors (GGUF bytes, fp8 values and scales, plain values),
    parameter by parameter."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return list(pa) == list(pb) and all(
        type(pa[n]) is type(pb[n]) and all(torch.equal(x, y) for x, y in zip(_locals(pa[n]), _locals(pb[n])))
        for n in pa)
