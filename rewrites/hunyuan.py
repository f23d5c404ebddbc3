"""`HunyuanDiT2DModel` (diffusers `hunyuan_transformer_2d.py`): the `hunyuan-dit` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its class's defaults
do not construct (`in_channels=None`, `patch_size=None`): only a published config builds it.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import get_2d_rotary_pos_embed
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel, HunyuanDiTBlock

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def hunyuan_dit_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `HunyuanDiT2DModel.forward`: a square latent of `image_tokens` patches, both
    text streams (CLIP and T5, as long as the config's `text_len` / `text_len_t5`: the model pads them with its
    learned padding by mask, the last token of each masked), the size conditions and style of v1.0/v1.1, and the 2-D
    rotary table of the patch grid, computed as `HunyuanDiTPipeline` does (`text_tokens` is unused: the model's
    padding parameter fixes the text lengths)."""
    generator = torch.Generator().manual_seed(seed)
    grid = int(image_tokens ** 0.5)
    side = grid * config.get("patch_size", 2)
    head_dim = config.get("attention_head_dim", 88)
    clip, t5 = config.get("text_len", 77), config.get("text_len_t5", 256)
    mask, mask_t5 = torch.ones(batch, clip, dtype=torch.long), torch.ones(batch, t5, dtype=torch.long)
    mask[:, -1:] = 0
    mask_t5[:, -1:] = 0
    rotary = get_2d_rotary_pos_embed(head_dim, ((0, 0), (grid, grid)), (grid, grid), use_real=True)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, clip, config.get("cross_attention_dim", 1024), generator=generator),
        text_embedding_mask=mask,
        encoder_hidden_states_t5=torch.randn(batch, t5, config.get("cross_attention_dim_t5", 2048),
                                             generator=generator),
        text_embedding_mask_t5=mask_t5,
    )
    if config.get("use_style_cond_and_image_meta_size", True):  # v1.2 on reads neither
        inputs.update(image_meta_size=torch.tensor([[1024.0, 1024.0, 1024.0, 1024.0, 0.0, 0.0]] * batch),
                      style=torch.zeros(batch, dtype=torch.long))
    return {**cast_inputs(inputs, dtype, device), "image_rotary_emb": tuple(t.to(device=device, dtype=dtype)
                                                                              for t in rotary)}


# the Tencent-Hunyuan/HunyuanDiT-Diffusers transformer's config.json (DiT-g/2), which diffusers'
# scripts/convert_hunyuandit_to_diffusers.py loads and edits only in `use_style_cond_and_image_meta_size`
_HUNYUAN_DIT = dict(num_attention_heads=16, attention_head_dim=88, in_channels=4, patch_size=2,
                    activation_fn="gelu-approximate", sample_size=128, hidden_size=1408, num_layers=40,
                    mlp_ratio=4.3637, learn_sigma=True, cross_attention_dim=1024, norm_type="layer_norm",
                    cross_attention_dim_t5=2048, pooled_projection_dim=1024, text_len=77, text_len_t5=256)


_HUNYUAN_DIT_TINY = dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8,
                         hidden_size=32, mlp_ratio=2.0, cross_attention_dim=16, cross_attention_dim_t5=16,
                         pooled_projection_dim=8, text_len=4, text_len_t5=6, use_style_cond_and_image_meta_size=True)


FAMILY = derived_family(
    "hunyuan-dit", HunyuanDiT2DModel, attention=(Attention,), processors=GENERIC,
    variants={
        "v1.2": {**_HUNYUAN_DIT, "use_style_cond_and_image_meta_size": False},
        "v1.1": {**_HUNYUAN_DIT, "use_style_cond_and_image_meta_size": True},
    },
    sources="Tencent-Hunyuan/HunyuanDiT-v1.2-Diffusers and -v1.1-Diffusers transformer/config.json: the "
    "HunyuanDiT-Diffusers config (40 blocks of 16 heads x 88, mlp_ratio 4.3637) that diffusers "
    "scripts/convert_hunyuandit_to_diffusers.py loads, with use_style_cond_and_image_meta_size False from v1.2",
    default_variant="v1.2",
    example_inputs=hunyuan_dit_inputs,
    tp=TensorParallel(replicated={HunyuanDiTBlock: {
        "skip_linear": "the long skip's projection reads a LayerNorm over cat([hidden, skip]) at full width "
        "(the residual stream every rank holds whole); one per block past the middle (19 of 40), 2 x 1408 -> 1408"}}),
    tests=Tests(
        # "tiny" runs sharded; "tiny_skip"'s last block reads a long skip (`skip_linear`, whole on every rank), as
        # every block past the middle does (four blocks of fp32 noise through the skips exceed the gradient tolerance
        # at world 2, where float64 agrees to 1e-15)
        configs={
            "tiny": dict(_HUNYUAN_DIT_TINY, num_layers=2),
            "tiny_skip": dict(_HUNYUAN_DIT_TINY, num_layers=4, use_style_cond_and_image_meta_size=False),
        },
    ),
)
