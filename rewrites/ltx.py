"""`LTXVideoTransformer3DModel` (diffusers `transformer_ltx.py`): the `ltx-video` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its processors rotate
q and k across the whole attention width before splitting heads, so the family row names the attention's rotary
arguments (`TensorParallel(rotary=...)`): rewrites/ltx2.py says how the derived plan shares the tables.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoTransformer3DModel

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import text_with_mask, video_grid


def ltx_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `LTXVideoTransformer3DModel.forward`: `image_tokens` patchified latent tokens on
    a frames x height x width grid, the pipeline's RoPE interpolation scale (VAE strides over 25 fps)."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    text, mask = text_with_mask(generator, batch, text_tokens, config.get("caption_channels", 4096))
    inputs = dict(
        hidden_states=torch.randn(batch, frames * height * width, config.get("in_channels", 128), generator=generator),
        encoder_hidden_states=text,
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_attention_mask=mask,
    )
    inputs = {k: v.to(device=device, dtype=dtype if k != "encoder_attention_mask" else v.dtype)
              for k, v in inputs.items()}
    return {**inputs, "num_frames": frames, "height": height, "width": width,
            "rope_interpolation_scale": (8 / 25, 32, 32)}


_LTX = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
            activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads", norm_elementwise_affine=False,
            norm_eps=1e-6, caption_channels=4096, attention_bias=True, attention_out_bias=True)


# cross_attention_dim is the width the caption projection gives: the model's own (heads x head_dim). The configs the
# suite shards hold one block: from the second block on, these seeded models' q/k gradients are ill-conditioned in
# fp32 (a 1e-7 relative perturbation of the weights moves them by up to 2e-5 (LTX-Video) and 6e-5 (LTX-2), measured),
# so any change of summation order exceeds the gradient tolerance; tests/families/test_ltx.py shards two blocks in
# float64 instead.
_LTX_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                 num_layers=1, caption_channels=16)


FAMILY = derived_family(
    "ltx-video", LTXVideoTransformer3DModel, attention=(LTXAttention,),
    variants={
        "2b": {**_LTX, "attention_head_dim": 64, "cross_attention_dim": 2048, "num_layers": 28},
        "13b": {**_LTX, "attention_head_dim": 128, "cross_attention_dim": 4096, "num_layers": 48},
    },
    sources="diffusers scripts/convert_ltx_to_diffusers.py (get_transformer_config: LTX-Video 0.9.0-0.9.6 2B, "
    "0.9.7+ 13B)",
    default_variant="13b",
    example_inputs=ltx_inputs,
    tp=TensorParallel(rotary={LTXAttention: ("image_rotary_emb",)}),
    tests=Tests(configs={"tiny": _LTX_TINY, "tiny_2_blocks": {**_LTX_TINY, "num_layers": 2}}),
)
