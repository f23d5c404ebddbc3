"""`ZImageTransformer2DModel` (diffusers `transformer_z_image.py`): the `z-image` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

from surgery.extend import Tests, derived_family


def z_image_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `ZImageTransformer2DModel.forward`, which takes lists (one entry per sample): a
    one-frame latent `[channels, 1, h, w]` of `image_tokens` patches and the caption features `[tokens, dim]`."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("all_patch_size", (2,))[0]
    cast = dict(device=device, dtype=dtype)
    return dict(
        x=[torch.randn(config.get("in_channels", 16), 1, side, side, generator=generator).to(**cast)
           for _ in range(batch)],
        cap_feats=[torch.randn(text_tokens, config.get("cap_feat_dim", 2560), generator=generator).to(**cast)
                   for _ in range(batch)],
        t=(torch.rand(batch, generator=generator)).to(**cast),
    )


FAMILY = derived_family(
    "z-image", ZImageTransformer2DModel, attention=(Attention,),
    variants={
        "turbo": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                      n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                      cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
                      axes_lens=[1024, 512, 512]),
    },
    sources="diffusers ZImageTransformer2DModel's defaults, the Tongyi-MAI/Z-Image-Turbo transformer "
    "(docs/source/en/api/models/z_image_transformer2d.md)",
    default_variant="turbo",
    example_inputs=z_image_inputs,
    tests=Tests(configs={"tiny": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2,
                                      n_refiner_layers=1, n_heads=4, n_kv_heads=4, qk_norm=True, cap_feat_dim=16,
                                      axes_dims=[4, 4, 4], axes_lens=[256, 32, 32])}),
)
