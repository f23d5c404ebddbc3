"""diffusers' features on an unfused model: LoRA adapters (plain and under TP), diffusers' hooks, and the interop that
the public verbs call after swapping modules (`interop.keep_diffusers_in_step`).
"""

from surgery.integration import lora, lora_tp, diffusers_hooks, interop  # noqa: F401  (in layer order)
