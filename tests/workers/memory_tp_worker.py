"""What each gloo rank runs for diffusers' memory features with tensor parallelism: each enabled on the sharded
model (after `tensor_parallel`) against the unsharded model with the same feature, and enabled before sharding
(refused)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

warnings.filterwarnings("ignore")

import surgery  # noqa: E402
from surgery.core.errors import SurgeryError  # noqa: E402
from flux2_testing import build, inputs, rel_err, small_config  # noqa: E402

CPU = torch.device("cpu")
FEATURES = {
    "layerwise_casting": lambda m: m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
                                                              compute_dtype=torch.float32),
    "group_offload_block": lambda m: m.enable_group_offload(onload_device=CPU, offload_device=CPU,
                                                            offload_type="block_level", num_blocks_per_group=1),
    "group_offload_leaf": lambda m: m.enable_group_offload(onload_device=CPU, offload_device=CPU,
                                                           offload_type="leaf_level"),
    "accelerate_cpu_offload": lambda m: __import__("accelerate").cpu_offload(m, execution_device=CPU),
}


def run(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    config = small_config("tp_wide")
    kw = inputs(config, seed=0, batch=2)
    unfused = surgery.unfuse(build(config, seed=0))
    out = {}
    for name, enable in FEATURES.items():
        row = {}
        whole = copy.deepcopy(unfused)
        enable(whole)
        with torch.no_grad():
            expected = whole(**kw, return_dict=False)[0]
        model = surgery.tensor_parallel(copy.deepcopy(unfused), mesh)
        try:
            enable(model)
            with torch.no_grad():
                row["after"] = rel_err(model(**kw, return_dict=False)[0], expected)
        except Exception as error:  # noqa: BLE001 - recorded: a feature that breaks on DTensors
            row["after_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        row["local_dtypes"] = sorted({str(p.to_local().dtype) for p in model.parameters()
                                      if isinstance(p, DTensor) and p.placements[0].is_shard()})
        model = copy.deepcopy(unfused)
        enable(model)
        try:
            surgery.tensor_parallel(model, mesh)
            row["before"] = None
        except SurgeryError as error:
            row["before"] = str(error)
        out[name] = row
    return out
