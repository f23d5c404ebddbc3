"""`PixArtTransformer2DModel` (diffusers `pixart_transformer_2d.py`): the `pixart` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its processors reshape
by the stored head count in the older spelling (`head_dim = inner_dim // attn.heads`), which the processor rule of
`surgery.core.leaves` reads.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def pixart_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `PixArtTransformer2DModel.forward`: a square latent of `image_tokens` patches,
    text of `caption_channels` with a padding mask (its last 2 tokens masked: the cross attention's mask path), a
    timestep, and resolution / aspect ratio where the config conditions on them (PixArt-alpha at 1024)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels") or 4096,
                                          generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
    )
    inputs = cast_inputs(inputs, dtype, device)
    # an integer mask, as a tokenizer gives it: a float one would ask for its gradient, which on a rank is that of
    # its own heads only (the head-dim twin broadcasts one mask over the rank's heads)
    inputs["encoder_attention_mask"] = mask.to(device=device, dtype=torch.long)
    conditions = config.get("use_additional_conditions")
    if conditions is None:
        conditions = config.get("sample_size", 128) == 128
    resolution = torch.tensor([[float(side * 8)] * 2] * batch)
    inputs["added_cond_kwargs"] = ({"resolution": resolution.to(device=device, dtype=dtype),
                                    "aspect_ratio": torch.ones(batch, 1, device=device, dtype=dtype)}
                                   if conditions else {"resolution": None, "aspect_ratio": None})
    return inputs


FAMILY = derived_family(
    "pixart", PixArtTransformer2DModel, attention=(Attention,), processors=GENERIC,
    variants={
        "alpha-1024": {"sample_size": 128, "caption_channels": 4096, "use_additional_conditions": True},
        "sigma-1024": {"sample_size": 128, "caption_channels": 4096, "use_additional_conditions": False,
                       "interpolation_scale": 2},
    },
    sources="transformer/config.json of PixArt-alpha/PixArt-XL-2-1024-MS and "
    "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS (28 layers, 16 heads of 72, cross attention 1152: the class "
    "defaults; diffusers scripts/convert_pixart_alpha_to_diffusers.py, convert_pixart_sigma_to_diffusers.py)",
    default_variant="sigma-1024",
    example_inputs=pixart_inputs,
    tests=Tests(configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8,
                                      num_layers=2, cross_attention_dim=32, caption_channels=16, sample_size=8,
                                      use_additional_conditions=False)}),
)
