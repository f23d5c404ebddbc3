"""`WanAnimate2Transformer3DModel` (diffusers `transformer_wan_animate_2.py`): the `wan-animate-2` family.

Derived (`surgery.extend.derived_family`): this file is data only (the published config with its source, test
configs, example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its
attention (`WanAnimate2Attention`) normalizes q and k with a `torch.nn.RMSNorm` over the whole width (heads x
head_dim): `surgery.unfuse` computes it elementwise (`ElementwiseRMSNorm`), so a rank's share of the heads
normalizes by one all-reduce of the statistic, and both processors run their head-dim twins.

The model runs in two passes: the reference pass (`kv_cache_mode="extract"`) stores each layer's pre-rotary k/v in a
`WanAnimate2KVCache`, the denoising pass (`"cached"`) reads it back. Sharded, each rank stores and reads its own
heads' k/v (the cache holds `[batch, tokens, heads / N, head_dim]`), so both passes shard alike.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_wan_animate_2 as animate2

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs

CLIP_DIM = 1280  # `MLPProj` fixes the CLIP vision width


def wan_animate_2_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                         frames: int = 2, **_) -> dict:
    """Seeded keyword arguments of the reference pass (`kv_cache_mode="extract"`, the pass that fills a fresh
    `WanAnimate2KVCache`), as diffusers' own test drives it: per sample a latent of `frames` frames with
    `image_tokens` patches each, its conditioning latents (the in channels less the latent's), the text, and the CLIP
    image tokens. The text fills the model's `text_len` whatever `text_tokens` asks (a longer one cannot run): the
    forward pads a shorter one with zero rows, all alike after the text embedding, whose like keys make a cross
    attention's key-norm gradient a sum of terms that cancel to rounding (4 text tokens at the published width:
    1.1e-03 of it off between sharded and whole)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    ph, pw = config.get("patch_size", (1, 2, 2))[1:]
    latent = config.get("out_dim", 16)
    condition = config.get("in_dim", 36) - latent
    shape = (frames, side * ph, side * pw)
    text_len = config.get("text_len", 512)
    inputs = dict(
        hidden_states=[torch.randn(latent, *shape, generator=generator) for _ in range(batch)],
        condition_latents=[torch.randn(condition, *shape, generator=generator) for _ in range(batch)],
        encoder_hidden_states=[torch.randn(text_len, config.get("text_dim", 4096), generator=generator)
                               for _ in range(batch)],
        timestep=torch.ones(batch),
        encoder_hidden_states_image=torch.randn(batch, 4, CLIP_DIM, generator=generator),
    )
    inputs = {k: [t.to(device=device, dtype=dtype) for t in v] if isinstance(v, list) else v for k, v in inputs.items()}
    return {**cast_inputs(inputs, dtype, device),
            "kv_cache": animate2.WanAnimate2KVCache(config.get("num_layers", 40)), "kv_cache_mode": "extract",
            "seq_len": frames * side * side,
            "offset_grid_sizes": torch.tensor([[frames, side, side]] * batch, dtype=torch.long)}


FAMILY = derived_family(
    "wan-animate-2", animate2.WanAnimate2Transformer3DModel, attention=(animate2.WanAnimate2Attention,),
    # the class's defaults: the Wan2.2-Animate 14B backbone (dim 5120 = 40 heads x 128, 40 layers, ffn 13824, in_dim 36)
    variants={"14b": dict(patch_size=(1, 2, 2), text_len=512, in_dim=36, dim=5120, ffn_dim=13824, freq_dim=256,
                          text_dim=4096, out_dim=16, num_heads=40, num_layers=40, cross_attn_norm=True, eps=1e-6,
                          use_img_emb=True)},
    sources="WanAnimate2Transformer3DModel's defaults in diffusers 0.42.1, the checkpoint its docs load "
    "(Wan-AI/Wan2.2-Animate-2-14B-Diffusers, wan_animate_2_transformer_3d.md) was not read here and no conversion "
    "script ships; the widths are those of Wan-Video/Wan2.2's WanAnimateModel defaults "
    "(wan/modules/animate/model_animate.py)",
    default_variant="14b",
    example_inputs=wan_animate_2_inputs,
    tests=Tests(
        # diffusers' tests/models/transformers/test_models_transformer_wan_animate_2.py
        # (WanAnimate2TransformerTesterConfig)
        configs={"tiny": dict(patch_size=(1, 2, 2), text_len=16, in_dim=36, dim=128, ffn_dim=256, freq_dim=64,
                              text_dim=32, out_dim=16, num_heads=4, num_layers=2, cross_attn_norm=True,
                              use_img_emb=True)},
    ),
)
