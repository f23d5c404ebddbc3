"""The forms of one module of a model, as graphs: fused (if it is), unfused, and one rank's under tensor parallelism.

Everything runs on a meta copy of the model (nothing allocated, the model untouched); the sharded form is planned
under torch's fake process group, so any `tp` fits one CPU.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.distributed.device_mesh import init_device_mesh

from surgery.core.errors import SurgeryError
from surgery.core.rewrite import unfuse
from surgery.core.walk import find_modules
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.plans import planned_modules
from surgery.parallel.tensor_parallel import tensor_parallel
from surgery.sight.graph import block_graph
from surgery.sight.trace import BlockGraph

# --- the three forms of one module of a model ------------------------------------------------------------------------


def default_module(model: nn.Module) -> str:
    """The module a diagram shows by default: the fused (or unfused) module with the most slices, else the first
    module with a tensor-parallel plan."""

    found = find_modules(model, fused=True) or find_modules(model, fused=False)
    if found:
        return max(found, key=lambda f: len(f[2].slices(f[1])))[0]
    planned = planned_modules(model)
    if planned:
        return planned[0][0]
    raise SurgeryError(
        f"surgery.sight.diagram: '{type(model).__name__}' has no module that unfuse rewrites or tensor_parallel shards; "
        "pass module='path.to.module' to draw another one."
    )


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with every parameter and buffer on the meta device (the original is not touched)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise SurgeryError("surgery.sight.diagram: the model is already sharded (DTensor parameters); pass the unsharded "
                           "model, and tp=N to draw one rank's graph.")
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class _Captured(Exception):
    pass


def capture(model: nn.Module, path: str, inputs: dict) -> tuple[tuple, dict]:
    """The (args, kwargs) that `model(**inputs)` passes to its submodule `path` (the first call; the forward stops
    there)."""
    try:
        target = model.get_submodule(path)
    except AttributeError:
        raise SurgeryError(f"surgery.sight.diagram: '{type(model).__name__}' has no submodule '{path}'.") from None
    seen: dict = {}

    def hook(module, args, kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise _Captured

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise SurgeryError(f"surgery.sight.diagram: '{path}' never ran in one forward of '{type(model).__name__}'.")
    return seen["args"], seen["kwargs"]


def _to_meta(inputs: dict) -> dict:
    return pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, inputs)


def forms(model: nn.Module, inputs: dict, module: str | None = None, tp: int | None = None, rank: int = 0
          ) -> list[BlockGraph]:
    """The graphs of `module` (a path in `model`; default `default_module`): fused (if it is fused), unfused, and
    with `tp`, rank `rank`'s local graph under tensor parallelism with its collectives.

    `inputs` are `model`'s forward keyword arguments; the module's own inputs are captured from one forward. All of it
    runs on a meta copy of `model` (nothing allocated, the model untouched); the sharded form is planned under
    torch's fake process group, as `surgery plan` does, so any `tp` fits one CPU.
    """

    base = meta_copy(model)
    inputs = _to_meta(inputs)
    path = module if module is not None else default_module(base)
    if path not in dict(base.named_modules()):
        raise SurgeryError(f"surgery.sight.diagram: '{type(model).__name__}' has no submodule '{path}'.")
    graphs = []

    def draw(model_form: nn.Module, title: str) -> BlockGraph:
        args, kwargs = capture(model_form, path, inputs)
        return block_graph(model_form.get_submodule(path), args, kwargs, title=title)

    if find_modules(base.get_submodule(path), fused=True):
        graphs.append(draw(base, f"fused {path}"))
    unfuse(base)
    graphs.append(draw(base, f"unfused {path}"))
    if tp:
        with fake_process_group(tp, rank):
            sharded = meta_copy(base)
            tensor_parallel(sharded, init_device_mesh("cpu", (tp,)), src_data_rank=None)
            graphs.append(draw(sharded, f"rank {rank} of {tp} (tensor parallel)"))
    return graphs


