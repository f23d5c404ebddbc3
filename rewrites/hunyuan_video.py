"""HunyuanVideo (diffusers `HunyuanVideoTransformer3DModel`, text-to-video and both image-to-video variants).

Every block keeps its diffusers class and forward (`surgery.core.leaves`):

| module (diffusers class, kept)                    | swapped                                                       |
|---------------------------------------------------|---------------------------------------------------------------|
| `HunyuanVideoSingleTransformerBlock`,             | `proj_out` (reads `cat([attn, mlp], dim=2)`) ->               |
| `HunyuanVideoTokenReplaceSingleTransformerBlock`  | `SplitProjection` (`.attn_part` with the bias, `.mlp_part`);  |
|                                                   | `attn`'s processor                                            |
| `HunyuanVideoTransformerBlock`,                   | `attn`'s processor only                                       |
| `HunyuanVideoTokenReplaceTransformerBlock`        |                                                               |
| `HunyuanVideoIndividualTokenRefinerBlock`         | `attn`'s processor only                                       |

Why the processors: every HunyuanVideo attention processor reshapes by the global head count
(`unflatten(2, (attn.heads, -1))` in `HunyuanVideoAttnProcessor2_0`; `view(batch, -1, attn.heads, head_dim)` and a
mask repeated `attn.heads` times in the refiner's `AttnProcessor2_0`). On a rank that holds a column shard of q/k/v
those split each head into pieces, so stock tensor parallelism would run and be wrong. Their twins
(`surgery.core.leaves.head_dim_twin`) are the stock source with the processor rule's edits (`rule_edits`): heads split
by `head_dim`, and the refiner's per-sample mask broadcast over however many heads a rank holds.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoIndividualTokenRefinerBlock,
    HunyuanVideoSingleTransformerBlock,
    HunyuanVideoTokenReplaceSingleTransformerBlock,
    HunyuanVideoTokenReplaceTransformerBlock,
    HunyuanVideoTransformer3DModel,
    HunyuanVideoTokenRefiner,
    HunyuanVideoTransformerBlock,
)

from surgery.core.errors import SurgeryError
from surgery.extend import Processors, TensorParallel, Tests, columns, derived_family, swap_rewrite
from surgery_rewrites.diffusers_common import video_grid

PROCESSORS = Processors((HunyuanVideoAttnProcessor2_0,))
REFINER_PROCESSORS = Processors((AttnProcessor2_0,))
PROJ_OUT = columns("proj_out", lambda block: block.attn.inner_dim)

REWRITES = (
    swap_rewrite("hunyuan_video.single_block", HunyuanVideoSingleTransformerBlock, leaves=(PROJ_OUT,),
                 children={"attn": PROCESSORS}),
    swap_rewrite("hunyuan_video.token_replace_single_block", HunyuanVideoTokenReplaceSingleTransformerBlock,
                 leaves=(PROJ_OUT,), children={"attn": PROCESSORS}),
    swap_rewrite("hunyuan_video.double_block", HunyuanVideoTransformerBlock, children={"attn": PROCESSORS}),
    swap_rewrite("hunyuan_video.token_replace_double_block", HunyuanVideoTokenReplaceTransformerBlock,
                 children={"attn": PROCESSORS}),
    swap_rewrite("hunyuan_video.token_refiner_block", HunyuanVideoIndividualTokenRefinerBlock,
                 children={"attn": REFINER_PROCESSORS}),
    # an attention given a stock processor after unfuse (set_attn_processor): found, refused by tensor_parallel as
    # still fused, and swapped by the next unfuse. (Not for the refiner's generic AttnProcessor2_0, which every
    # diffusers `Attention` may run: a refiner attention given it back stays whole under tensor_parallel.)
    swap_rewrite("hunyuan_video.attention", Attention, processors=PROCESSORS),
)

# --- tensor-parallel plans: derived (`surgery.extend.derived_family`) ---------------------------------------------
# The double-stream blocks' and the token refiner's attention (diffusers' generic `Attention` running a head-dim twin)
# and their FeedForwards: heads and hidden units split across ranks, one all-reduce per output projection. The
# single-stream blocks (FLUX.1's layout): heads and MLP hidden units split; the SplitProjection's halves leave partial
# sums, resolved once on its output (before the gate and the residual): one all-reduce per block.

# --- the family: published configs, example inputs, test configs ------------------------------------------------------

# diffusers scripts/convert_hunyuan_video_to_diffusers.py TRANSFORMER_CONFIGS ("HYVideo-T/2-cfgdistill",
# "HYVideo-T/2-I2V-16ch", "HYVideo-T/2-I2V-33ch"); hunyuanvideo-community/HunyuanVideo transformer/config.json.
_T2V = dict(
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
    rope_axes_dim=(16, 56, 56), image_condition_type=None,
)
VARIANTS = {
    "t2v": _T2V,
    # HunyuanVideo-I2V, token-replace revision: first-frame tokens replaced by the image's and modulated at t=0
    "i2v": dict(_T2V, image_condition_type="token_replace"),
    # HunyuanVideo-I2V, first revision: image latents and a mask channel concatenated to the noise (16 * 2 + 1)
    "i2v-33ch": dict(_T2V, in_channels=33, guidance_embeds=False, image_condition_type="latent_concat"),
}


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `HunyuanVideoTransformer3DModel.forward`: a video latent of `image_tokens` patches
    (`video_grid`), `text_tokens` of text with the last one of every sample but the first masked as padding."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p, p_t = config.get("patch_size", 2), config.get("patch_size_t", 1)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[1:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames * p_t, height * p, width * p,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, config.get("pooled_projection_dim", 768), generator=generator),
        guidance=torch.full((batch,), 6000.0) if config.get("guidance_embeds", True) else None,
    )
    return {
        k: None if v is None else v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        for k, v in inputs.items()
    }


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count, MLP ratio and text width; fewer blocks, smaller heads."""
    if head_dim % 8:
        raise SurgeryError(f"head_dim {head_dim} is not a multiple of 8 (3 rotary axes of even size)")
    quarter = head_dim // 4
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                rope_axes_dim=(quarter, quarter, 2 * quarter))


def _small(**config) -> dict:
    rope = {8: (2, 2, 4), 12: (4, 4, 4), 16: (4, 6, 6)}[config["attention_head_dim"]]
    base = dict(in_channels=4, out_channels=4, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=8)
    return dict(base, rope_axes_dim=rope, **config)


# The first one is sharded at world 2 and 4 (4 heads, widths 32 and 128).
TEST_CONFIGS = {
    "tp_small": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8),
    # HunyuanVideo-I2V (token replace): both token-replace block kinds
    "i2v_token_replace_small": _small(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=12,
                                      image_condition_type="token_replace"),
    # HunyuanVideo-I2V-33ch (latent concat), no guidance, odd heads, fractional MLP ratio: int(48 * 2.5) = 120
    "i2v_latent_concat_small": _small(num_layers=1, num_single_layers=1, num_attention_heads=3,
                                      attention_head_dim=16, in_channels=9, mlp_ratio=2.5, guidance_embeds=False,
                                      image_condition_type="latent_concat"),
}

FAMILY = derived_family(
    "hunyuan-video", HunyuanVideoTransformer3DModel,
    variants=VARIANTS,
    sources="diffusers scripts/convert_hunyuan_video_to_diffusers.py (TRANSFORMER_CONFIGS); "
    "hunyuanvideo-community/HunyuanVideo and HunyuanVideo-I2V transformer/config.json",
    default_variant="t2v",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=reduced,
    tp=TensorParallel(replicated={HunyuanVideoTokenRefiner: {
        "proj_in": "the text states' input projection, ahead of the refiner blocks (text tokens only, small)",
        "token_refiner.refiner_blocks.*.norm_out.linear": "adaLN modulation of the replicated conditioning embedding",
    }}),
    tests=Tests(configs=TEST_CONFIGS),
)
