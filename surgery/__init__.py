"""surgery: rewrite fused diffusion-transformer modules into equivalent unfused ones, then shard them with stock TP.

    import surgery
    surgery.unfuse(model)                 # in place; returns model
    surgery.tensor_parallel(model, mesh)  # stock parallelize_module; returns model
    surgery.fuse(model)                   # the exact inverse of unfuse
"""

from .checks import SurgeryError
from .registry import Rewrite, register, registered
from .rewrite import RewriteRecord, find_modules, fuse, last_report, unfuse
from .slicing import Slice
from .state_dict import fuse_state_dict, key_map, unfuse_state_dict

__all__ = [
    "Rewrite",
    "RewriteRecord",
    "Slice",
    "SurgeryError",
    "find_modules",
    "fuse",
    "fuse_state_dict",
    "key_map",
    "last_report",
    "register",
    "registered",
    "unfuse",
    "unfuse_state_dict",
]
