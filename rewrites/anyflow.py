"""`AnyFlowTransformer3DModel` (diffusers `transformer_anyflow.py`): the `anyflow` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_anyflow as anyflow

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import WAN, WAN_TINY, cast_inputs


def anyflow_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `AnyFlowTransformer3DModel.forward`: a video latent laid out frames first,
    `[batch, frames, channels, h, w]`, of `image_tokens` patches in two frames; the flow map's two times per frame
    (`timestep` t and `r_timestep` r < t); the text."""
    generator = torch.Generator().manual_seed(seed)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    frames = 2
    per_frame = image_tokens // frames
    height = max(d for d in range(1, int(per_frame ** 0.5) + 1) if per_frame % d == 0)
    t = torch.rand(batch, 1, generator=generator).expand(batch, frames) * 1000
    inputs = dict(
        hidden_states=torch.randn(batch, frames * p_t, config.get("in_channels", 16), height * p_h,
                                  per_frame // height * p_w, generator=generator),
        timestep=t.contiguous(), r_timestep=(t * 0.5).contiguous(),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 4096), generator=generator),
    )
    return cast_inputs(inputs, dtype, device)


# Wan2.1-T2V's transformer/config.json (diffusers scripts/convert_wan_to_diffusers.py) as AnyFlow's conversion loads
# it, less the keys the AnyFlow classes do not take (qk_norm: their q/k norms are always across heads)
_ANYFLOW = {**{k: v for k, v in WAN.items() if k != "qk_norm"}, "in_channels": 16, "gate_value": 0.25,
            "deltatime_type": "r"}


_ANYFLOW_1_3B = {**_ANYFLOW, "ffn_dim": 8960, "num_attention_heads": 12, "num_layers": 30}


_ANYFLOW_14B = {**_ANYFLOW, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}


# heads of 12, as diffusers' AnyFlow tests: the 3D rotary table splits head_dim in three even parts
_ANYFLOW_TINY = {**{k: v for k, v in WAN_TINY.items() if k != "freq_dim"}, "attention_head_dim": 12,
                 "freq_dim": 256, "gate_value": 0.25, "deltatime_type": "r"}


FAMILY = derived_family(
    "anyflow", anyflow.AnyFlowTransformer3DModel, attention=(anyflow.AnyFlowAttention,),
    variants={"wan2.1-t2v-1.3b": _ANYFLOW_1_3B, "wan2.1-t2v-14b": _ANYFLOW_14B},
    sources="diffusers scripts/convert_anyflow_to_diffusers.py (VARIANTS: AnyFlow-Wan2.1-T2V-1.3B/14B-Diffusers "
    "load Wan-AI/Wan2.1-T2V-1.3B/14B-Diffusers' transformer config with gate_value=0.25, deltatime_type='r'; "
    "those configs: scripts/convert_wan_to_diffusers.py)",
    default_variant="wan2.1-t2v-14b",
    example_inputs=anyflow_inputs,
    tests=Tests(configs={"tiny": _ANYFLOW_TINY}),
)
