"""surgery: rewrite fused diffusion-transformer modules into equivalent unfused ones, then shard them with stock TP.

    import surgery
    surgery.unfuse(model)                 # in place; returns model
    surgery.tensor_parallel(model, mesh)  # stock parallelize_module; returns model
    surgery.fuse(model)                   # the exact inverse of unfuse
"""

from .checkpoint import convert_checkpoint
from .checks import SurgeryError
from .context_parallel import context_parallel
from .loading import load_tensor_parallel
from .lora import fuse_lora_state_dict, unfuse_lora_state_dict
from .distributed import CollectiveCounter, run_on_cpu_ranks
from .registry import Rewrite, register, register_tp_plan, registered, tp_plans
from .rewrite import RewriteRecord, find_modules, fuse, last_report, unfuse
from .slicing import Slice
from .state_dict import fuse_state_dict, key_map, unfuse_state_dict
from .tensor_parallel import diffusers_tp_plan, planned_modules, tensor_parallel
from .verify import rel_err

__all__ = [
    "CollectiveCounter",
    "Rewrite",
    "RewriteRecord",
    "Slice",
    "convert_checkpoint",
    "load_tensor_parallel",
    "SurgeryError",
    "find_modules",
    "fuse",
    "fuse_lora_state_dict",
    "fuse_state_dict",
    "key_map",
    "last_report",
    "diffusers_tp_plan",
    "planned_modules",
    "register",
    "register_tp_plan",
    "registered",
    "rel_err",
    "run_on_cpu_ranks",
    "tensor_parallel",
    "tp_plans",
    "unfuse",
    "unfuse_lora_state_dict",
    "unfuse_state_dict",
]
