"""`SanaTransformer2DModel` (diffusers `sana_transformer.py`): the `sana` family.

Derived from diffusers' building blocks (`surgery.extend.derived_family`), data only (published configs with their
source, tiny test configs, example inputs).

Its self-attention is linear attention (`SanaLinearAttnProcessor2_0` / `3_0`: ReLU kernels, then per-head sums `V K^T
Q`): every sum runs within one head, so it shards by heads like softmax attention, and the processor rule of
`surgery.core.leaves` gives those processors their head-dim twins (they reshape by `(attn.heads, -1)`); the cross
attention is diffusers' own processor in the older spelling, which the rule also reads.

Its feed-forward (`GLUMBConv`: 1x1 conv up to gate and value channels, a depthwise 3x3 conv, the GLU, a 1x1 conv down)
is Conv2d, not Linear: stock `ColwiseParallel`/`RowwiseParallel` refuse a Conv2d, and DTensor's convolution shards
only the batch or spatial dims with the weight whole, never its channels. It stays whole on every rank, declared so,
and `surgery plan` reports the bytes that leaves unsharded.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0
from diffusers.models.transformers.sana_transformer import GLUMBConv, SanaAttnProcessor2_0, SanaTransformer2DModel

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import CONV_FEED_FORWARD, cast_inputs, sana_conditions


def sana_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SanaTransformer2DModel.forward`: a square latent of `image_tokens` patches plus
    `sana_conditions`."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 1)
    latent = torch.randn(batch, config.get("in_channels", 32), side, side, generator=generator)
    conditions = sana_conditions(config, batch, text_tokens, generator)
    return cast_inputs(dict(hidden_states=latent, **conditions), dtype, device)


# diffusers scripts/convert_sana_to_diffusers.py: transformer_kwargs over model_kwargs[model_type]
_SANA = dict(in_channels=32, out_channels=32, caption_channels=2304, mlp_ratio=2.5, attention_bias=False,
             sample_size=32, patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None)


_SANA_1600M = dict(num_attention_heads=70, attention_head_dim=32, num_cross_attention_heads=20,
                   cross_attention_head_dim=112, cross_attention_dim=2240, num_layers=20)


_SANA_600M = dict(num_attention_heads=36, attention_head_dim=32, num_cross_attention_heads=16,
                  cross_attention_head_dim=72, cross_attention_dim=1152, num_layers=28)


_SPRINT = dict(qk_norm="rms_norm_across_heads", guidance_embeds=True)


# heads of Sana's 32: linear attention divides by a sum of ReLU kernels over the head's features and the tokens,
# which at heads of 8 and 16 tokens comes near zero often enough that fp32 rounding alone (a sum in another order)
# moves q's gradient by 1e-5, the gradient tolerance. The sharded case runs one block: through two, the q/k norms'
# weight gradients (sums over tokens that nearly cancel) differ from one device by up to 1.1e-5 over seeds 0-9 at
# world 2, at one block by 5.4e-6 at most
_SANA_TINY = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=32,
                  num_cross_attention_heads=4, cross_attention_head_dim=32, cross_attention_dim=128,
                  caption_channels=16, num_layers=2, sample_size=4, mlp_ratio=2.5)


FAMILY = derived_family(
    "sana", SanaTransformer2DModel, attention=(Attention,),
    processors=(SanaAttnProcessor2_0, SanaLinearAttnProcessor2_0),
    variants={
        "1600m-1024px": {**_SANA, **_SANA_1600M},
        "600m-1024px": {**_SANA, **_SANA_600M},
        "1600m-4kpx": {**_SANA, **_SANA_1600M, "sample_size": 128, "interpolation_scale": 2.0},
        "1.5-1600m": {**_SANA, **_SANA_1600M, "qk_norm": "rms_norm_across_heads"},
        "1.5-4800m": {**_SANA, **_SANA_1600M, "num_layers": 60, "qk_norm": "rms_norm_across_heads"},
        "sprint-1600m": {**_SANA, **_SANA_1600M, **_SPRINT},
        "sprint-600m": {**_SANA, **_SANA_600M, **_SPRINT},
    },
    sources="diffusers scripts/convert_sana_to_diffusers.py (model_kwargs: SanaMS_1600M_P1_D20, "
    "SanaMS_600M_P1_D28, SanaMS1.5_1600M_P1_D20, SanaMS1.5_4800M_P1_D60, SanaSprint_1600M_P1_D20, "
    "SanaSprint_600M_P1_D28; sample_size = image_size // 32, interpolation_scale by image size)",
    default_variant="1600m-1024px",
    example_inputs=sana_inputs,
    tp=TensorParallel(replicated={GLUMBConv: {"conv_*": CONV_FEED_FORWARD}}),
    tests=Tests(
        # the sharded case is Sprint's: q/k norms across heads and the guidance embedder
        configs={"tiny_sprint": {**_SANA_TINY, **_SPRINT, "num_layers": 1}, "tiny": _SANA_TINY},
    ),
)
