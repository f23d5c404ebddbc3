"""`DiTTransformer2DModel` (diffusers `dit_transformer_2d.py`): the `dit` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its processors reshape
by the stored head count in the older spelling (`head_dim = inner_dim // attn.heads`), which the processor rule of
`surgery.core.leaves` reads.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def dit_inputs(config: dict, batch: int = 1, image_tokens: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", **_) -> dict:
    """Seeded keyword arguments for `DiTTransformer2DModel.forward`: a square latent of `image_tokens` patches, a
    timestep and an ImageNet class label (DiT is class-conditional: no text)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
        class_labels=torch.randint(0, config.get("num_embeds_ada_norm", 1000), (batch,), generator=generator),
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = derived_family(
    "dit", DiTTransformer2DModel, attention=(Attention,), processors=GENERIC,
    variants={"xl-2-256": {"sample_size": 32, "out_channels": 8}, "xl-2-512": {"sample_size": 64, "out_channels": 8}},
    sources="diffusers scripts/convert_dit_to_diffusers.py (DiT-XL-2-256 and DiT-XL-2-512: 28 layers, 16 heads of "
    "72, out_channels 8, sample_size image_size // 8)",
    default_variant="xl-2-256",
    example_inputs=dit_inputs,
    tests=Tests(configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8,
                                      num_layers=2, sample_size=8, num_embeds_ada_norm=10)}),
)
