"""LoRA adapters on an unfused model, plain or tensor-parallel, in diffusers' (fused) layout on disk.

diffusers' own `load_lora_adapter` / `save_lora_adapter` / PEFT's `add_adapter` work on an unfused model as on the
stock one (`surgery.unfuse` installs the translation); these are the pieces underneath, for state dicts in hand.
"""

from surgery.integration.lora import (
    fuse_lora_state_dict,
    lora_target_modules,
    stock_lora_adapter,
    unfuse_lora_state_dict,
)
from surgery.integration.lora_tp import shard_lora

__all__ = ["unfuse_lora_state_dict", "fuse_lora_state_dict", "lora_target_modules", "stock_lora_adapter", "shard_lora"]
