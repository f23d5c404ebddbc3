"""Tiny FLUX.1 and QwenImage pipelines built offline (FLUX.2-dev's is `pipeline_testing.dev_pipeline`): seeded
transformer, VAE and text encoders; the BPE tokenizer trained in `pipeline_testing` stands in for CLIP's and T5's
(no sentencepiece model here), and for Qwen2.5-VL's."""

from __future__ import annotations

import torch

import pipeline_testing as P
from surgery.core.registry import families
from surgery.testing import seeded_model

HIDDEN = 32


def _tokenizer(max_length: int | None = None):
    tok = P.tokenizer()
    if max_length is not None:
        tok.model_max_length = max_length  # FluxPipeline pads CLIP prompts to the tokenizer's model_max_length
    return tok


def flux1_pipeline(seed: int = 0):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from surgery_rewrites.flux import small

    clip_tok, t5_tok = _tokenizer(16), _tokenizer()
    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=HIDDEN, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                                        eos_token_id=2)).eval()
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                 dropout_rate=0.0)).eval()
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                        norm_num_groups=4, sample_size=32, shift_factor=0.1159, scaling_factor=0.3611).eval()
    config = dict(small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                        joint_attention_dim=HIDDEN, guidance_embeds=True), pooled_projection_dim=HIDDEN)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok,
                        transformer=seeded_model(families()["flux1"], config, seed))


def qwenimage_pipeline(seed: int = 0):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from surgery_rewrites.qwenimage import _small

    tok = _tokenizer()
    torch.manual_seed(seed)
    text = dict(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]))
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN,
                  fullatt_block_indexes=[0])
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4).eval()
    config = _small(num_layers=2, num_attention_heads=4, attention_head_dim=8, joint_attention_dim=HIDDEN)
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=encoder,
                             tokenizer=tok, transformer=seeded_model(families()["qwen-image"], config, seed))


def generate(kind: str, pipe, seed: int = 0) -> torch.Tensor:
    kwargs = dict(prompt="a red fox in fresh snow", height=32, width=32, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(seed), output_type="pt")
    if kind == "flux2_dev":
        return P.generate(pipe, max_sequence_length=64)
    if kind == "flux1":
        return pipe(**kwargs, max_sequence_length=16, guidance_scale=3.5).images
    return pipe(**kwargs, max_sequence_length=16).images


PIPELINES = {"flux2_dev": P.dev_pipeline, "flux1": flux1_pipeline, "qwenimage": qwenimage_pipeline}
