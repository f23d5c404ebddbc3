"""`Kandinsky6SRTransformer3DModel` (diffusers `transformer_kandinsky6_sr.py`): the `kandinsky6-sr` family, Kandinsky
6's text-free video super-resolution transformer.

Derived (`surgery.extend.derived_family`): this file is data only. Its self-attention reshapes by the stored head
count and attends through NABLA's sparse `BlockMask`, built per head from that head's own query/key block
statistics: the processor rule's head-dim twin lets a rank build its own heads' mask and attend them with `flex`
attention as the whole model does. `flex` attention has no backward on CPU (torch 2.13), so the conformance suite
checks this family's gradients with that one kernel computed by diffusers' native backend on the `BlockMask` made
dense (`Tests.flex_backward`): the plan, the projections and the norms whose gradients the check compares are the
same under both kernels, and the suite checks that both kernels give the same forward.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_kandinsky6_sr as sr

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def kandinsky6_sr_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Kandinsky6SRTransformer3DModel.forward`: two latent frames of `(B, T, H, W, C)`
    tiles (the noisy latent, the anchor latent and its mask: `2 * in_visual_dim + 1` channels) whose token grid is
    the smallest NABLA takes, one 8x8 block per frame (`image_tokens` is not used: NABLA needs that grid), and a
    timestep on the `[0, 1000]` scale. The model takes no text."""
    generator = torch.Generator().manual_seed(seed)
    _, p_h, p_w = config.get("patch_size", (1, 1, 1))
    block, frames = sr.FRACTAL_BLOCK_SIZE, 4
    inputs = dict(
        hidden_states=torch.randn(batch, frames, block * p_h, block * p_w, 2 * config.get("in_visual_dim", 64) + 1,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = derived_family(
    "kandinsky6-sr", sr.Kandinsky6SRTransformer3DModel, attention=(sr.Kandinsky6SRAttention,),
    variants={"vsr": {}},
    sources="diffusers 0.42.1 Kandinsky6SRTransformer3DModel: its defaults (1792 wide = 14 heads of 16+24+24 = 64, 32 "
    "blocks, 7168 feed-forward, 64 K-VAE channels in, 640 out: the PiflowScheduler checkpoints' n_grid x 64), the "
    "transformer of kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers (Kandinsky6SRPipeline's example)",
    default_variant="vsr",
    example_inputs=kandinsky6_sr_inputs,
    tests=Tests(
        # diffusers 0.42.1 ships no Kandinsky 6 SR model test: the released architecture at tiny widths, 4 heads of
        # 2+2+4 = 8 (a mesh of 4 splits them), two blocks; a sliding-tile window of one block (not the released 11 x 7 x
        # 7, which at two 8x8 blocks admits every block) so that NABLA's own per-head selection shapes the mask
        configs={"tiny": dict(in_visual_dim=4, out_visual_dim=8, time_dim=16, model_dim=32, ff_dim=64,
                              num_visual_blocks=2, axes_dims=(2, 2, 4), nabla_window=(1, 1, 1), nabla_threshold=0.7)},
        flex_backward="native",
    ),
)
