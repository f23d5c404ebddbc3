"""`SkyReelsV2Transformer3DModel` (diffusers `transformer_skyreels_v2.py`): the `skyreels-v2` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Wan's numbers and
example inputs, which the models built like it share, are in diffusers_common.py.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2Attention, SkyReelsV2Transformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import WAN, WAN_TINY, wan_inputs


FAMILY = derived_family(
    "skyreels-v2", SkyReelsV2Transformer3DModel, attention=(SkyReelsV2Attention,),
    variants={
        "df-1.3b": {**WAN, "ffn_dim": 8960, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30,
                    "inject_sample_info": True},
        "t2v-14b": {**WAN, "ffn_dim": 13824, "in_channels": 16, "num_attention_heads": 40, "num_layers": 40},
        "i2v-1.3b": {**WAN, "ffn_dim": 8960, "in_channels": 36, "num_attention_heads": 12, "num_layers": 30,
                     "image_dim": 1280, "added_kv_proj_dim": 1536},
    },
    sources="diffusers scripts/convert_skyreelsv2_to_diffusers.py (SkyReels-V2-DF-1.3B-540P, "
    "SkyReels-V2-T2V-14B-720P, SkyReels-V2-I2V-1.3B-540P)",
    default_variant="t2v-14b",
    example_inputs=wan_inputs,
    tests=Tests(configs={"tiny": WAN_TINY}),
)
