"""What each family's published pipeline holds besides its transformer: data for `surgery plan --pipeline`.

Each entry: the `--model` name (`Family.model_name(variant)`) -> the pipeline class and its components, each `(class, config class or None,
config)`: built on the meta device from these numbers (a transformers model from its config class, a diffusers model
from init arguments); the transformer is the family's own variant. `SOURCES` says where the numbers come from. No
plan lives here (the text encoders' plans are transformers' own, or `rewrites/t5.py`), so `FAMILY` carries none.
"""

from __future__ import annotations

from surgery.extend import Family

# mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json (FLUX.2-dev's text_encoder/ is this model)
MISTRAL_SMALL_3_1 = (
    "transformers.Mistral3ForConditionalGeneration", "transformers.Mistral3Config",
    dict(
        text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                         num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14),
        image_token_index=10, multimodal_projector_bias=False, projector_hidden_act="gelu", spatial_merge_size=2,
        tie_word_embeddings=False,
    ),
)


def _qwen3(hidden: int, intermediate: int, tie: bool) -> tuple:
    return ("transformers.Qwen3ForCausalLM", "transformers.Qwen3Config",
            dict(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=tie))


QWEN3_4B, QWEN3_8B = _qwen3(2560, 9728, True), _qwen3(4096, 12288, False)  # Qwen/Qwen3-4B, Qwen/Qwen3-8B

# google/t5-v1_1-xxl config.json (FLUX.1's text_encoder_2, Chroma's and Bria's text_encoder)
T5_XXL = ("transformers.T5EncoderModel", "transformers.T5Config",
          dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, tie_word_embeddings=False))

# google/byt5-small config.json (HunyuanImage-2.1's glyph encoder, text_encoder_2)
BYT5_SMALL = ("transformers.T5EncoderModel", "transformers.T5Config",
              dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                   feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, tie_word_embeddings=False))

# openai/clip-vit-large-patch14 text_config (FLUX.1's and HunyuanVideo's CLIP text encoder)
CLIP_L = ("transformers.CLIPTextModel", "transformers.CLIPTextConfig",
          dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
               num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768))

# Qwen/Qwen2.5-VL-7B-Instruct config.json (QwenImage's, LongCat-Image's and HunyuanImage-2.1's text_encoder)
QWEN25_VL_7B = (
    "transformers.Qwen2_5_VLForConditionalGeneration", "transformers.Qwen2_5_VLConfig",
    dict(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]),
                         tie_word_embeddings=False),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        tie_word_embeddings=False,
    ),
)

# xtuner/llava-llama-3-8b-v1_1 (HunyuanVideo's text_encoder: its LlamaModel)
LLAMA3_8B = ("transformers.LlamaModel", "transformers.LlamaConfig",
             dict(vocab_size=128320, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192))

# hunyuanvideo-community/HunyuanVideo-I2V text_encoder/ (llava-llama-3-8b whole: CLIP ViT-L/14-336 tower, Llama-3-8B)
LLAVA_LLAMA3_8B = (
    "transformers.LlavaForConditionalGeneration", "transformers.LlavaConfig",
    dict(
        text_config=dict(model_type="llama", **LLAMA3_8B[2]),
        vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                           projection_dim=768),
        image_token_index=128257, projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    ),
)

# HuggingFaceTB/SmolLM3-3B config.json (Bria-Fibo's text_encoder)
SMOLLM3_3B = ("transformers.SmolLM3ForCausalLM", "transformers.SmolLM3Config",
              dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536, pad_token_id=128004,
                   tie_word_embeddings=True))

# diffusers' VAEs: their published configs are the classes' defaults, except FLUX.1's (16 latent channels)
FLUX1_VAE = ("diffusers.AutoencoderKL", None,
             dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                  use_quant_conv=False, use_post_quant_conv=False))
FLUX2_VAE = ("diffusers.AutoencoderKLFlux2", None, {})
QWEN_VAE = ("diffusers.AutoencoderKLQwenImage", None, {})
HUNYUAN_VIDEO_VAE = ("diffusers.AutoencoderKLHunyuanVideo", None, {})

_FLUX1 = {"pipeline": "FluxPipeline", "vae": FLUX1_VAE, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL}

PIPELINES: dict[str, dict] = {
    "flux2-dev": {"pipeline": "Flux2Pipeline", "vae": FLUX2_VAE, "text_encoder": MISTRAL_SMALL_3_1},
    "flux2-klein-4b": {"pipeline": "Flux2KleinPipeline", "vae": FLUX2_VAE, "text_encoder": QWEN3_4B},
    "flux2-klein-9b": {"pipeline": "Flux2KleinPipeline", "vae": FLUX2_VAE, "text_encoder": QWEN3_8B},
    **{f"flux1-{v}": _FLUX1 for v in ("dev", "schnell", "kontext-dev", "fill-dev", "depth-dev")},
    **{f"chroma-{v}": {"pipeline": "ChromaPipeline", "vae": FLUX1_VAE, "text_encoder": T5_XXL}
       for v in ("hd", "base")},
    "bria-3.2": {"pipeline": "BriaPipeline", "vae": FLUX1_VAE, "text_encoder": T5_XXL},
    "bria-fibo": {"pipeline": "BriaFiboPipeline", "text_encoder": SMOLLM3_3B},
    **{name: {"pipeline": "QwenImagePipeline", "vae": QWEN_VAE, "text_encoder": QWEN25_VL_7B}
       for name in ("qwen-image", "qwen-image-edit", "qwen-image-edit-2511")},
    "longcat-image-base": {"pipeline": "LongCatImagePipeline", "vae": FLUX1_VAE, "text_encoder": QWEN25_VL_7B},
    **{f"hunyuan-image-{v}": {"pipeline": "HunyuanImagePipeline",
                              "text_encoder": QWEN25_VL_7B, "text_encoder_2": BYT5_SMALL}
       for v in ("2.1", "2.1-distilled")},
    "hunyuan-video-t2v": {"pipeline": "HunyuanVideoPipeline", "vae": HUNYUAN_VIDEO_VAE,
                          "text_encoder": LLAMA3_8B, "text_encoder_2": CLIP_L},
    # image to video: the whole Llava model (its vision tower reads the image), not only its LlamaModel
    **{f"hunyuan-video-{v}": {"pipeline": "HunyuanVideoImageToVideoPipeline", "vae": HUNYUAN_VIDEO_VAE,
                              "text_encoder": LLAVA_LLAMA3_8B, "text_encoder_2": CLIP_L}
       for v in ("i2v", "i2v-33ch")},
}

SOURCES = (
    "Text encoders: the config.json of the checkpoints each pipeline's text_encoder/ holds (named beside each entry "
    "above; Mistral-Small-3.1-24B for FLUX.2-dev, Qwen3-4B/8B for FLUX.2-klein, T5-v1.1-XXL and CLIP ViT-L/14 for "
    "FLUX.1, Chroma and Bria, Qwen2.5-VL-7B for QwenImage / LongCat / HunyuanImage, llava-llama-3-8b for "
    "HunyuanVideo (its LlamaModel for text to video, the whole Llava model for image to video), SmolLM3-3B for "
    "Bria-Fibo, byT5-small for HunyuanImage's glyph encoder), written from those files, not downloaded here. VAEs: diffusers 0.42.1's class defaults (FLUX.1's 16-channel AutoencoderKL from "
    "black-forest-labs/FLUX.1-dev vae/config.json). HunyuanImage's and Bria-Fibo's VAEs (their classes have no defaults), Ovis-Image, Motif-Video and QwenImage-2.1 "
    "(Qwen3-VL, whose transformers config ships a plan for its embedding only) are not recorded."
)


FAMILY = Family(name="pipelines", model_class=None, sources=SOURCES, pipelines=PIPELINES)
