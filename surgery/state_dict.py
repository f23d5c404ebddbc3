"""State dicts and checkpoints between the fused (diffusers) layout and the unfused one.

`weight_slices(model)` lists which rows or columns of each fused tensor each unfused tensor is; the two conversions
apply that table to a state dict, `convert_checkpoint` to a checkpoint folder on disk (streaming, atomic).
"""

from surgery.core.state_dict import fuse_state_dict, unfuse_state_dict, weight_slices
from surgery.io.checkpoint import convert_checkpoint

__all__ = ["weight_slices", "unfuse_state_dict", "fuse_state_dict", "convert_checkpoint"]
