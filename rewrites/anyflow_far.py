"""`AnyFlowFARTransformer3DModel` (diffusers `transformer_anyflow_far.py`): the `anyflow-far` family, AnyFlow's
causal (FAR) Wan2.1 backbone for chunk-wise autoregressive video.

Derived (`surgery.extend.derived_family`): this file is data only. Its causal self-attention
(`AnyFlowCausalAttnProcessor`) runs `flex` attention over a FAR `BlockMask` and reshapes by the stored head count:
the processor rule gives it, like its cross-attention, a head-dim twin, so a rank attends its own heads under the
same mask (the mask names no head). `flex` attention has no backward on CPU (torch 2.13), so the conformance suite
checks this family's gradients with that one kernel computed by diffusers' native backend on the `BlockMask` made
dense (`Tests.flex_backward`): the plan, the projections and the norms whose gradients the check compares are the
same under both kernels, and the suite checks that both kernels give the same forward.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_anyflow_far as far

from surgery.extend import Tests, derived_family
from surgery_rewrites.anyflow import _ANYFLOW
from surgery_rewrites.diffusers_common import cast_inputs


def anyflow_far_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments of the causal training rollout (`AnyFlowFARTransformer3DModel.forward` without a KV
    cache), as diffusers' own test drives it: four latent frames in two chunks of two (`chunk_partition`), each
    frame of `image_tokens` patches (its side a multiple of the compressed patch, so the earlier chunk can be
    compressed), the flow map's two times per frame (r < t) and the text."""
    generator = torch.Generator().manual_seed(seed)
    _, p_h, p_w = config.get("compressed_patch_size", (1, 4, 4))
    side = max(int(image_tokens ** 0.5), 1)
    chunks = [2, 2]
    frames = sum(chunks)
    size = side * config.get("patch_size", (1, 2, 2))[1]
    size = (size + p_h - 1) // p_h * p_h
    t = torch.rand(batch, 1, generator=generator).expand(batch, frames) * 1000
    inputs = dict(
        hidden_states=torch.randn(batch, frames, config.get("in_channels", 16), size, size, generator=generator),
        timestep=t.contiguous(), r_timestep=(t * 0.5).contiguous(),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 4096), generator=generator),
    )
    return {**cast_inputs(inputs, dtype, device), "chunk_partition": chunks}


# AnyFlow's published FAR checkpoints: Wan2.1-T2V's transformer config with the FAR flags of diffusers'
# scripts/convert_anyflow_to_diffusers.py (VARIANTS: AnyFlow-FAR-Wan2.1-1.3B/14B-Diffusers)
_FAR = {**_ANYFLOW, "full_chunk_limit": 3, "compressed_patch_size": (1, 4, 4), "chunk_partition": (1, 3, 3, 3, 3, 3, 3, 2)}


FAMILY = derived_family(
    "anyflow-far", far.AnyFlowFARTransformer3DModel, attention=(far.AnyFlowAttention,),
    variants={"wan2.1-1.3b": {**_FAR, "ffn_dim": 8960, "num_attention_heads": 12, "num_layers": 30},
              "wan2.1-14b": {**_FAR, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}},
    sources="diffusers scripts/convert_anyflow_to_diffusers.py (VARIANTS: AnyFlow-FAR-Wan2.1-1.3B/14B-Diffusers load "
    "Wan-AI/Wan2.1-T2V-1.3B/14B-Diffusers' transformer config with gate_value=0.25, deltatime_type='r', "
    "full_chunk_limit=3, compressed_patch_size=[1, 4, 4], chunk_partition=[1, 3, 3, 3, 3, 3, 3, 2]; those configs: "
    "scripts/convert_wan_to_diffusers.py)",
    default_variant="wan2.1-14b",
    example_inputs=anyflow_far_inputs,
    tests=Tests(
        # diffusers' tests/models/transformers/test_models_transformer_anyflow_far.py (AnyFlowFARTransformer3DTesterConfig)
        # with 4 heads instead of 2 (a mesh of 4 splits them)
        configs={"tiny": dict(patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3,
                              num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
                              text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                              rope_max_seq_len=32, gate_value=0.25, deltatime_type="r")},
        flex_backward="native",
    ),
)
