"""`ChronoEditTransformer3DModel` (diffusers `transformer_chronoedit.py`): the `chronoedit` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Wan's numbers and
example inputs, which the models built like it share, are in diffusers_common.py.
"""

from __future__ import annotations

from diffusers.models.transformers import transformer_chronoedit as chronoedit

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import WAN, WAN_TINY, wan_inputs


FAMILY = derived_family(
    "chronoedit", chronoedit.ChronoEditTransformer3DModel, attention=(chronoedit.WanAttention,),
    variants={
        "14b": {**WAN, "ffn_dim": 13824, "in_channels": 36, "num_attention_heads": 40, "num_layers": 40,
                "image_dim": 1280, "added_kv_proj_dim": 5120, "rope_max_seq_len": 1024},
    },
    sources="nvidia/ChronoEdit-14B-Diffusers: Wan2.1-I2V-14B's transformer (diffusers scripts/"
    "convert_wan_to_diffusers.py, Wan-I2V-14B-720p; the same numbers in an early copy of its transformer/"
    "config.json, huggingface.co/NopenAI/nv-chronoedit) with ChronoEdit's default rope_temporal_skip_len=8",
    default_variant="14b",
    # 16 image tokens make 2 latent frames: ChronoEdit's two-frame (edit) rotary path
    example_inputs=wan_inputs,
    tests=Tests(configs={"tiny_i2v": {**WAN_TINY, "image_dim": 8, "added_kv_proj_dim": 32}, "tiny": WAN_TINY}),
)
