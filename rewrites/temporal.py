"""`TransformerTemporalModel` (diffusers `transformer_temporal.py`): the `transformer-temporal` family, the temporal
transformer of the text-to-video UNet (`UNet3DConditionModel`: ModelScope's text-to-video-ms-1.7b), which attends
over the frames of each pixel.

Derived (`surgery.extend.derived_family`): its `BasicTransformerBlock`s run diffusers' generic `Attention` (two self
attentions: `double_self_attention`), whose processors the processor rule of `surgery.core.leaves` reads; its
feed-forward's GEGLU is split into hidden and gate rows (`GEGLU_ROWS`, rewrites/diffusers_common.py). `proj_in` and
`proj_out` sit outside the transformer blocks: whole on every rank.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_temporal import TransformerTemporalModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def temporal_inputs(config: dict, batch: int = 1, image_tokens: int = 16, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", frames: int = 4,
                    **_) -> dict:
    """Seeded keyword arguments for `TransformerTemporalModel.forward`, as `UNet3DConditionModel` calls it: the
    feature map of `batch` videos of `frames` frames stacked on the batch dim, `image_tokens` pixels each (each pixel
    attends over its frames), and the frame count."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    hidden = torch.randn(batch * frames, config.get("in_channels") or 320, side, side, generator=generator)
    return {**cast_inputs(dict(hidden_states=hidden), dtype, device), "num_frames": frames}


# UNet3DConditionModel builds two shapes of it from damo-vilab/text-to-video-ms-1.7b's unet/config.json
# (attention_head_dim 64, block_out_channels 320/640/1280/1280, norm_num_groups 32, cross_attention_dim 1024):
# `transformer_in` (8 heads of 64 over the first block's 320 channels) and each block's (its channels over 64 heads,
# `num_attention_heads = attention_head_dim`; the widest: 1280 = 64 heads of 20)
FAMILY = derived_family(
    "transformer-temporal", TransformerTemporalModel, attention=(Attention,), processors=GENERIC,
    variants={
        "t2v-ms-1.7b-in": dict(num_attention_heads=8, attention_head_dim=64, in_channels=320, num_layers=1,
                               norm_num_groups=32),
        "t2v-ms-1.7b-1280": dict(num_attention_heads=64, attention_head_dim=20, in_channels=1280, num_layers=1,
                                 cross_attention_dim=1024, norm_num_groups=32),
    },
    sources="diffusers' UNet3DConditionModel.__init__ (transformer_in; unet_3d_blocks' temporal transformers) over "
    "damo-vilab/text-to-video-ms-1.7b's unet/config.json as diffusers' text-to-video tests and docs load it "
    "(attention_head_dim 64, block_out_channels (320, 640, 1280, 1280), 32 groups, cross_attention_dim 1024); the "
    "config.json unverified here",
    default_variant="t2v-ms-1.7b-in",
    example_inputs=temporal_inputs,
    # the shape of UNet3DConditionModel's tests (tests/models/unets/test_models_unet_3d_condition.py: 8 heads), shrunk:
    # 4 heads of 8 over 32 channels in 8 groups, 2 layers
    tests=Tests(configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=32, num_layers=2,
                                      norm_num_groups=8)}),
)
