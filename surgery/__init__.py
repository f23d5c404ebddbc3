"""surgery: rewrite fused diffusion-transformer modules into equivalent unfused ones, then shard them with stock TP.

    import surgery
    surgery.unfuse(model)                 # in place; returns model
    surgery.tensor_parallel(model, mesh)  # stock parallelize_module; returns model
    surgery.fuse(model)                   # the exact inverse of unfuse

Test helpers (rel_err, CollectiveCounter, run_on_cpu_ranks, seeded models, diffusers' packed baseline) live in
`surgery.testing`; inspection in `surgery.inspect`.
"""

from .checkpoint import convert_checkpoint
from .checks import SurgeryError
from .context_parallel import context_parallel
from .loading import load_tensor_parallel
from .lora import fuse_lora_state_dict, lora_target_modules, shard_lora, stock_lora_adapter, unfuse_lora_state_dict
from .registry import Family, Rewrite, families, register, register_family, register_tp_plan, registered, tp_plans
from .rewrite import fuse, last_report, unfuse
from .saving import save_pretrained
from .slicing import Slice
from .state_dict import fuse_state_dict, key_map, unfuse_state_dict
from .tensor_parallel import tensor_parallel
from .pipeline import tensor_parallel_pipeline

__all__ = [
    # user verbs
    "unfuse",
    "fuse",
    "tensor_parallel",
    "tensor_parallel_pipeline",
    "context_parallel",
    "load_tensor_parallel",
    "convert_checkpoint",
    "last_report",
    "key_map",
    "unfuse_state_dict",
    "fuse_state_dict",
    "save_pretrained",
    "unfuse_lora_state_dict",
    "fuse_lora_state_dict",
    "lora_target_modules",
    "stock_lora_adapter",
    "shard_lora",
    "SurgeryError",
    # extension API
    "Family",
    "Rewrite",
    "Slice",
    "families",
    "register",
    "register_family",
    "register_tp_plan",
    "registered",
    "tp_plans",
]
