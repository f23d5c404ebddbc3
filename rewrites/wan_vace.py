"""`WanVACETransformer3DModel` (diffusers `transformer_wan_vace.py`): the `wan-vace` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Wan's numbers and
example inputs, which the models built like it share, are in diffusers_common.py.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttention
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformer3DModel, WanVACETransformerBlock

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import WAN, WAN_TINY, wan_inputs


def wan_vace_inputs(config: dict, **kwargs) -> dict:
    """`wan_inputs` plus a control video of `vace_in_channels` on the same latent grid."""
    inputs = wan_inputs(config, **kwargs)
    video = inputs["hidden_states"]
    generator = torch.Generator().manual_seed(kwargs.get("seed", 0) + 1)
    control = torch.randn(video.shape[0], config.get("vace_in_channels", 96), *video.shape[2:], generator=generator)
    return {**inputs, "control_hidden_states": control.to(video)}


FAMILY = derived_family(
    "wan-vace", WanVACETransformer3DModel, attention=(WanAttention,),
    variants={
        "1.3b": {**WAN, "ffn_dim": 8960, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30,
                 "vace_layers": list(range(0, 30, 2)), "vace_in_channels": 96},
    },
    sources="diffusers scripts/convert_wan_to_diffusers.py (get_transformer_config: Wan-VACE-1.3B)",
    default_variant="1.3b",
    example_inputs=wan_vace_inputs,
    tp=TensorParallel(
        # the VACE hint projections: proj_in reads the patch-embedded control video, proj_out writes the hint added
        # to the main stream; both full-width hidden states every rank holds whole between the sharded attentions
        replicated={WanVACETransformerBlock: dict.fromkeys(
            ("proj_in", "proj_out"), "VACE hint projection of full-width hidden states every rank holds whole")},
    ),
    tests=Tests(configs={"tiny": {**WAN_TINY, "vace_layers": [0, 1], "vace_in_channels": 8}}),
)
