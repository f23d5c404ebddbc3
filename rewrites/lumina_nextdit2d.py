"""`LuminaNextDiT2DModel` (diffusers `lumina_nextdit2d.py`): the `lumina-next` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its class's defaults
do not construct (`in_channels=None`, `patch_size=None`): only a published config builds it.
"""

from __future__ import annotations

from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.lumina_nextdit2d import LuminaNextDiT2DModel

from surgery.extend import derived_family
from surgery_rewrites.diffusers_common import GENERIC


FAMILY = derived_family(
    "lumina-next", LuminaNextDiT2DModel, attention=(Attention,), processors=GENERIC,
    variants={"sft": dict(sample_size=128, patch_size=2, in_channels=4, hidden_size=2304, num_layers=24,
                          num_attention_heads=32, num_kv_heads=8, multiple_of=256, ffn_dim_multiplier=None,
                          norm_eps=1e-5, learn_sigma=True, qk_norm=True, cross_attention_dim=2048,
                          scaling_factor=1.0)},
    sources="diffusers scripts/convert_lumina_to_diffusers.py (Alpha-VLLM/Lumina-Next-SFT-diffusers)",
    default_variant="sft",
)
