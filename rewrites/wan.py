"""`WanTransformer3DModel` (diffusers `transformer_wan.py`): the `wan` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Wan's numbers and
example inputs, which the models built like it share, are in diffusers_common.py.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import WAN, WAN_TINY, wan_inputs


FAMILY = derived_family(
    "wan", WanTransformer3DModel, attention=(WanAttention,),
    variants={
        "t2v-1.3b": {**WAN, "ffn_dim": 8960, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30},
        "t2v-14b": {**WAN, "ffn_dim": 13824, "in_channels": 16, "num_attention_heads": 40, "num_layers": 40},
        "i2v-14b": {**WAN, "ffn_dim": 13824, "in_channels": 36, "num_attention_heads": 40, "num_layers": 40,
                    "image_dim": 1280, "added_kv_proj_dim": 5120},
        "2.2-ti2v-5b": {**WAN, "ffn_dim": 14336, "in_channels": 48, "out_channels": 48,
                        "num_attention_heads": 24, "num_layers": 30},
    },
    sources="diffusers scripts/convert_wan_to_diffusers.py (get_transformer_config: Wan-T2V-1.3B, Wan-T2V-14B, "
    "Wan-I2V-14B-480p, Wan2.2-TI2V-5B)",
    default_variant="t2v-14b",
    example_inputs=wan_inputs,
    tests=Tests(configs={"tiny": WAN_TINY, "tiny_i2v": {**WAN_TINY, "image_dim": 8, "added_kv_proj_dim": 32}}),
)
