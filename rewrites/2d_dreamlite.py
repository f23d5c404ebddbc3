"""`DreamLiteTransformer2DModel` (diffusers `transformer_2d_dreamlite.py`): the `dreamlite` family, the transformers of
DreamLite's UNet (`DreamLiteUNetModel`: carlofkl/DreamLite-base and -mobile), each over one feature map of the UNet.

Derived (`surgery.extend.derived_family`), as the `transformer-2d` family: diffusers' generic `Attention` and a GEGLU
feed-forward (split into hidden and gate rows, `GEGLU_ROWS`). Two things differ, both data here:
- The UNet sets `DreamLiteAttnProcessor2_0` on every attention (`Family.processor`): the model's own default processor
  cannot run its one key/value head. That processor reads the stored head count beyond a reshape, so it runs
  unmodified on DTensor q/k/v (`surgery.parallel.dtensor_attention`).
- Multi-query attention: 64 query heads read one key/value head. One head cannot be split, so `to_k` and `to_v` stay
  whole on every rank (`surgery.parallel.derive.whole_key_values`); the query heads and the output projection are split.
`proj_in` and `proj_out` (1x1 convolutions) sit outside the transformer blocks: whole on every rank.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_2d_dreamlite import DreamLiteTransformer2DModel
from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def dreamlite_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **_) -> dict:
    """Seeded keyword arguments for `DreamLiteTransformer2DModel.forward`, as the DreamLite UNet calls it: a feature
    map of `image_tokens` pixels, the prompt's features and their 0/1 mask (the pipeline passes the text encoder's;
    here the last two tokens padding, so the cross attention's mask path runs)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config["in_channels"], side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("cross_attention_dim") or 2048,
                                          generator=generator),
        encoder_attention_mask=mask,
    )
    return cast_inputs(inputs, dtype, device)


# DreamLiteUNetModel's published defaults (diffusers' unet_dreamlite.py): attention_head_dim 64, which the UNet reads
# as 64 heads per block (diffusers issue #2011's naming), block_out_channels (320, 640, 1280), cross_attention_dim 2048,
# qk_norm "rms_norm", ff_mult 6, num_kv_heads 1, one transformer layer per block, 32 groups; the down blocks at 320 and
# 640 channels and the up block at 640 drop self-attention (use_self_attention=False)
UNET = dict(num_attention_heads=64, num_layers=1, cross_attention_dim=2048, norm_num_groups=32, qk_norm="rms_norm",
            ff_mult=6, num_kv_heads=1)

# the structure at tiny widths: 8 query heads of 4 over one key/value head, rms q/k norms, ff_mult 6, 2 layers
TINY = dict(num_attention_heads=8, attention_head_dim=4, in_channels=32, num_layers=2, cross_attention_dim=16,
            norm_num_groups=8, qk_norm="rms_norm", ff_mult=6, num_kv_heads=1)

FAMILY = derived_family(
    "dreamlite", DreamLiteTransformer2DModel, attention=(Attention,), processors=GENERIC,
    processor=DreamLiteAttnProcessor2_0,
    variants={
        "1280": {**UNET, "attention_head_dim": 20, "in_channels": 1280},
        "640": {**UNET, "attention_head_dim": 10, "in_channels": 640, "use_self_attention": False},
        "320": {**UNET, "attention_head_dim": 5, "in_channels": 320, "use_self_attention": False},
    },
    sources="diffusers' DreamLiteUNetModel.__init__ defaults and its blocks' DreamLiteTransformer2DModel calls "
    "(unet_dreamlite.py: 64 heads of block_out_channels / 64 over (320, 640, 1280), cross_attention_dim 2048, "
    "rms_norm qk_norm, ff_mult 6, one key/value head; the 320 and 640 blocks without self-attention), as "
    "carlofkl/DreamLite-base and -mobile load them (revision `diffusers`); their unet/config.json unverified here",
    default_variant="1280",
    example_inputs=dreamlite_inputs,
    # TINY, and the blocks without self-attention
    tests=Tests(configs={"tiny": TINY, "tiny-no-self-attention": {**TINY, "use_self_attention": False}}),
)
