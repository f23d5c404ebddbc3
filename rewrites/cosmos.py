"""`CosmosTransformer3DModel` (diffusers `transformer_cosmos.py`): the `cosmos` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import video_grid


# the numbers every Cosmos config shares
_COSMOS = dict(out_channels=16, attention_head_dim=128, mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256,
               max_size=(128, 240, 240), patch_size=(1, 2, 2), concat_padding_mask=True, extra_pos_embed_type=None)


# head size 12: the rotary embedding splits it in thirds of even sizes (h and w 4, t 4)
_COSMOS_TINY = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=12, num_layers=2,
                    mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8, max_size=(8, 16, 16),
                    concat_padding_mask=False)


def cosmos_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CosmosTransformer3DModel.forward`: a video latent of `image_tokens` patches with
    all `in_channels` (a Video2World condition mask is one of them), its frame rate, the text (as wide as the
    Predict2.5 cross-attention projection reads, where the config has one) and, where the config concatenates one,
    the padding mask."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    text = (config.get("crossattn_proj_in_channels", 1024) if config.get("use_crossattn_projection")
            else config.get("text_embed_dim", 1024))
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames * p_t, height * p_h, width * p_w,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, text, generator=generator),
    )
    if config.get("concat_padding_mask", True):
        inputs["padding_mask"] = torch.zeros(1, 1, height * p_h, width * p_w)
    inputs = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    return {**inputs, "fps": 24}


FAMILY = derived_family(
    "cosmos", CosmosTransformer3DModel, attention=(Attention,),
    variants={name: {**_COSMOS, **config} for name, config in {
        "1.0-7b-text2world": dict(in_channels=16, num_attention_heads=32, num_layers=28,
                                  rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type="learnable"),
        "1.0-7b-video2world": dict(in_channels=17, num_attention_heads=32, num_layers=28,
                                   rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type="learnable"),
        "1.0-14b-text2world": dict(in_channels=16, num_attention_heads=40, num_layers=36,
                                   rope_scale=(2.0, 2.0, 2.0), extra_pos_embed_type="learnable"),
        "1.0-14b-video2world": dict(in_channels=17, num_attention_heads=40, num_layers=36,
                                    rope_scale=(2.0, 2.0, 2.0), extra_pos_embed_type="learnable"),
        "predict2-2b-text2image": dict(in_channels=16, num_attention_heads=16, num_layers=28,
                                       rope_scale=(1.0, 4.0, 4.0)),
        "predict2-14b-text2image": dict(in_channels=16, num_attention_heads=40, num_layers=36,
                                        rope_scale=(1.0, 4.0, 4.0)),
        "predict2-2b-video2world": dict(in_channels=17, num_attention_heads=16, num_layers=28,
                                        rope_scale=(1.0, 3.0, 3.0)),
        "predict2-14b-video2world": dict(in_channels=17, num_attention_heads=40, num_layers=36,
                                         rope_scale=(20 / 24, 2.0, 2.0)),
        "predict2.5-2b": dict(in_channels=17, num_attention_heads=16, num_layers=28, rope_scale=(1.0, 3.0, 3.0),
                              use_crossattn_projection=True, crossattn_proj_in_channels=100352,
                              encoder_hidden_states_channels=1024),
        "predict2.5-14b": dict(in_channels=17, num_attention_heads=40, num_layers=36, rope_scale=(1.0, 3.0, 3.0),
                               use_crossattn_projection=True, crossattn_proj_in_channels=100352,
                               encoder_hidden_states_channels=1024),
    }.items()},
    sources="diffusers scripts/convert_cosmos_to_diffusers.py (TRANSFORMER_CONFIGS: Cosmos-1.0-Diffusion-7B/14B-"
    "Text2World/Video2World, Cosmos-2.0-Diffusion-2B/14B-Text2Image/Video2World, Cosmos-2.5-Predict-Base-2B/14B; "
    "Cosmos-2.5-Transfer's image-context attention is refused: its CosmosAttnProcessor2_5 views the image "
    "q/k/v by the stored head count)",
    default_variant="1.0-7b-text2world",
    example_inputs=cosmos_inputs,
    tests=Tests(
        # no padding mask: diffusers resizes it with torchvision, which this stack does not install (the mask is one
        # more input channel, read by the patch embedding every rank holds whole)
        configs={
            "tiny": {**_COSMOS_TINY, "extra_pos_embed_type": "learnable"},
            "tiny_predict2.5": {**_COSMOS_TINY, "extra_pos_embed_type": None, "use_crossattn_projection": True,
                                "crossattn_proj_in_channels": 24, "encoder_hidden_states_channels": 16},
        },
    ),
)
