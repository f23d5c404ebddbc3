"""Bria Fibo 2 (diffusers `transformer_bria_fibo2.py`): Z-Image's single-stream blocks over gist tokens (a Perceiver
resampler of the text) and image tokens, with text cross attention in the injection blocks. Its processor unflattens
by the stored head count only, so it runs its head-dim twin (the fast path); plans and the all-reduce count are
derived."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_bria_fibo2 import (
    BriaFibo2Attention,
    BriaFibo2AttnProcessor,
    BriaFibo2Transformer2DModel,
)

from surgery.extend import Tests, derived_family, register_edits

# The processor rule's head size is the module's `head_dim` or `inner_dim // heads`; this module keeps neither, so its
# twin reads the head size off the width its query projection declares (the whole module's on any rank).
register_edits(BriaFibo2AttnProcessor, "__call__", (("(attn.heads, -1)", "(-1, attn.to_q.out_features // attn.heads)", 3),))


def bria_fibo2_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `BriaFibo2Transformer2DModel.forward`: `(B, C, H, W)` latents whose patches make
    `image_tokens` tokens, a timestep in [0, 1], the text features as one bundle for the Perceiver and one per
    injection block, and a text mask whose last token is padding."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    bundles = 1 + len(config.get("injection_layer_ids", (6, 14, 22, 30, 38)))
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 32), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, bundles, text_tokens, config.get("cap_feat_dim", 7680),
                                          generator=generator),
        encoder_attention_mask=mask,
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILIES = (
    derived_family(
        "bria-fibo2", BriaFibo2Transformer2DModel, attention=(BriaFibo2Attention,),
        variants={"2.0": {}},
        sources="diffusers 0.42.1 BriaFibo2Transformer2DModel defaults (3584 wide, 44 blocks, 28 heads, 7680-wide "
        "text, injection blocks 6/14/22/30/38), taken as briaai/Fibo-2.0-dev's (the pipeline's example checkpoint; "
        "its config.json unverified here)",
        default_variant="2.0",
        example_inputs=bria_fibo2_inputs,
        tests=Tests(
            # diffusers 0.42.1 ships no BriaFibo2 model test (none in its tests/models/transformers), so this is the
            # smallest config of the architecture: 4 heads of 16 (a mesh of 2 and 4 splits them), one refiner block, two
            # main blocks of which the second injects the text, a one-layer Perceiver and 4 to 8 gist tokens
            configs={"tiny": dict(in_channels=4, patch_size=2, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4,
                                  cap_feat_dim=32, injection_layer_ids=(1,), perceiver_num_layers=1,
                                  min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=4, gist_min_text_len=2,
                                  gist_max_text_len=16, axes_dims=(8, 4, 4), axes_lens=(32, 16, 16))},
        ),
    ),
)
