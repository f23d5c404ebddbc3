"""diffusers' features on an unfused model: LoRA adapters (plain and under TP), diffusers' hooks, and the interop that
subscribes to the core's after-rewrite event (importing this package subscribes it).
"""

from surgery.integration import lora, lora_tp, diffusers_hooks, interop  # noqa: F401  (in layer order)
