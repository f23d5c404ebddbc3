"""diffusers' own packed tensor parallelism, applied directly, as the baseline that tests and benchmarks compare with."""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh


def diffusers_packed_tp(model: nn.Module, mesh: DeviceMesh, plan: dict | None = None) -> nn.Module:
    """Shard `model` with diffusers 0.42's `apply_tensor_parallel` (what `enable_parallelism` calls) over `mesh`.

    `plan` defaults to the model's `_tp_plan` (packed styles on a fused model; plain ones on an unfused model).
    diffusers refuses a CPU mesh; for a like-for-like comparison on gloo that one check is lifted here.
    """
    import diffusers.hooks.tensor_parallel as dtp
    from diffusers.models._modeling_parallel import TensorParallelConfig

    config = TensorParallelConfig(mesh=mesh)
    config.setup(mesh.get_rank(), mesh.size(), torch.device(mesh.device_type), mesh)
    supported = tuple(dict.fromkeys((*dtp._SUPPORTED_TP_DEVICES, mesh.device_type)))
    with mock.patch.object(dtp, "_SUPPORTED_TP_DEVICES", supported):
        dtp.apply_tensor_parallel(model, config, plan if plan is not None else model._tp_plan)
    return model
