"""`CogView3PlusTransformer2DModel` (diffusers `transformer_cogview3plus.py`): the `cogview3-plus` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its processors reshape
by the stored head count in the older spelling (`head_dim = inner_dim // attn.heads`), which the processor rule of
`surgery.core.leaves` reads.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_cogview3plus import CogView3PlusTransformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def cogview3plus_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CogView3PlusTransformer2DModel.forward`: a square latent of `image_tokens`
    patches, text of `text_embed_dim`, a timestep, and the size conditions (integer pixels, as the pipeline
    gives them)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
        original_size=torch.tensor([[side * 8, side * 8]] * batch),
        target_size=torch.tensor([[side * 8, side * 8]] * batch),
        crop_coords=torch.zeros(batch, 2, dtype=torch.long),
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = derived_family(
    "cogview3-plus", CogView3PlusTransformer2DModel, attention=(Attention,), processors=GENERIC,
    variants={"3b": {}},
    sources="diffusers scripts/convert_cogview3_to_diffusers.py (CogView3-Plus-3B: the class defaults, "
    "CogView3PlusTransformer2DModel())",
    default_variant="3b",
    example_inputs=cogview3plus_inputs,
    tests=Tests(configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                                      num_layers=2, text_embed_dim=16, time_embed_dim=16, condition_dim=4,
                                      pos_embed_max_size=8, sample_size=8)}),
)
