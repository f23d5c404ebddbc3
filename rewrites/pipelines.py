"""What each family's published pipeline holds besides its transformer: data for `surgery plan --pipeline`.

Each entry: the `--model` name (`Family.model_name(variant)`), or the name of a diffusers transformer class (every
variant of the family holding it), -> the pipeline class and its components, each `(class, config class or None,
config)`: built on the meta device from these numbers (a transformers model from its config class, a diffusers model
from init arguments); the transformer is the family's own variant. `SOURCES` says where the numbers come from. No
plan lives here (the text encoders' plans are transformers' own, or `rewrites/t5.py`, `umt5.py`, `clip.py`, `qwen3_vl.py`), so `FAMILY` carries none.
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

# google/umt5-xxl config.json (Wan 2.1 / 2.2's and SkyReels-V2's text_encoder/: UMT5EncoderModel)
UMT5_XXL = ("transformers.UMT5EncoderModel", "transformers.UMT5Config",
            dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, tie_word_embeddings=False))

# google-t5/t5-11b config.json (Cosmos' text_encoder: T5 v1.0, ReLU MLP)
T5_11B = ("transformers.T5EncoderModel", "transformers.T5Config",
          dict(vocab_size=32128, d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_heads=128,
               feed_forward_proj="relu", relative_attention_num_buckets=32))

# google/gemma-2-2b(-it) config.json (Sana's text_encoder, Efficient-Large-Model/gemma-2-2b-it; Lumina2's)
_GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                  sliding_window=4096, query_pre_attn_scalar=256, pad_token_id=0)
# T5GemmaConfig gives its module configs its dropout rates: the encoder class alone reads them from its own
T5GEMMA_2B_ENCODER = {**_GEMMA2_2B, "dropout_rate": 0.0, "attention_dropout": 0.0}
GEMMA2_2B = ("transformers.Gemma2Model", "transformers.Gemma2Config", _GEMMA2_2B)

# google/gemma-3-12b-it config.json (LTX-2's text_encoder: Gemma3ForConditionalGeneration, SigLIP tower included)
GEMMA3_12B = (
    "transformers.Gemma3ForConditionalGeneration", "transformers.Gemma3Config",
    dict(
        text_config=dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
                         query_pre_attn_scalar=256, max_position_embeddings=131072),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256,
    ),
)

# THUDM/glm-4-9b-hf config.json (CogView4's text_encoder: GlmModel)
GLM4_9B = ("transformers.GlmModel", "transformers.GlmConfig",
           dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                num_attention_heads=32, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5,
                attention_bias=True, max_position_embeddings=131072, pad_token_id=151329))

# google/t5gemma-2b-2b-ul2 config.json, its encoder (PRX's text_encoder: T5GemmaEncoder, a Gemma-2-2B stack)
T5GEMMA_2B = ("transformers.models.t5gemma.modeling_t5gemma.T5GemmaEncoder", "transformers.T5GemmaModuleConfig",
              T5GEMMA_2B_ENCODER)

# Qwen/Qwen3-VL-8B-Instruct config.json (QwenImage-2.1's text_encoder; its transformer's context_in_dim, 4096, is
# this model's hidden size)
QWEN3_VL_8B = (
    "transformers.Qwen3VLForConditionalGeneration", "transformers.Qwen3VLConfig",
    dict(
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                         rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True), tie_word_embeddings=False),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304),
        tie_word_embeddings=False,
    ),
)

# Qwen/Qwen3-VL-4B-Instruct config.json. Krea 2 (`Qwen3VLModel`, named in its pipeline's docstring: its transformer's
# text_hidden_dim, 2560, is this hidden size, and its 12 taps reach layer 35 of 36) and Bria-Fibo 2.0
# (`Qwen3VLForConditionalGeneration`: cap_feat_dim 7680 = 3 taps x 2560, up to layer 35)
_QWEN3_VL_4B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                          mrope_interleaved=True), tie_word_embeddings=True),
    vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       deepstack_visual_indexes=[5, 11, 17], num_position_embeddings=2304),
    tie_word_embeddings=True,
)
QWEN3_VL_4B_MODEL = ("transformers.Qwen3VLModel", "transformers.Qwen3VLConfig", _QWEN3_VL_4B)
QWEN3_VL_4B = ("transformers.Qwen3VLForConditionalGeneration", "transformers.Qwen3VLConfig", _QWEN3_VL_4B)
# Qwen3-VL-8B's `Qwen3VLModel` (Ideogram 4 runs `text_encoder.language_model`'s layers: llm_features_dim 53248 = its
# 13 taps x 4096)
QWEN3_VL_8B_MODEL = ("transformers.Qwen3VLModel", "transformers.Qwen3VLConfig", QWEN3_VL_8B[2])

# google-t5/t5-base config.json (Stable Audio Open's text_encoder, named in its pipeline's docstring; its
# transformer's cross_attention_input_dim is 768): the original T5, one ReLU `wi`
T5_BASE = ("transformers.T5EncoderModel", "transformers.T5Config",
           dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
                feed_forward_proj="relu", relative_attention_num_buckets=32))

# google/umt5-base config.json (LongCat-AudioDiT's text_encoder is a UMT5EncoderModel; its transformer's
# dit_text_dim, 768, is umt5-base's width)
UMT5_BASE = ("transformers.UMT5EncoderModel", "transformers.UMT5Config",
             dict(vocab_size=256384, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12,
                  feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, tie_word_embeddings=False))

# Qwen/Qwen3-Embedding-0.6B config.json (ACE-Step 1.5's text_encoder, named in its pipeline's docstring; its
# condition encoder's text_hidden_dim is 1024)
QWEN3_EMBEDDING_06B = ("transformers.Qwen3Model", "transformers.Qwen3Config",
                       dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                            max_position_embeddings=32768, tie_word_embeddings=True))

# Qwen2.5-VL-7B's text model alone (HunyuanVideo-1.5's text_encoder: Qwen2_5_VLTextModel)
QWEN25_VL_7B_TEXT = ("transformers.Qwen2_5_VLTextModel", "transformers.Qwen2_5_VLTextConfig",
                     QWEN25_VL_7B[2]["text_config"])

# meta-llama/Llama-3.1-8B-Instruct config.json (HiDream-I1's text_encoder_4: LlamaForCausalLM)
LLAMA31_8B = ("transformers.LlamaForCausalLM", "transformers.LlamaConfig",
              dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192),
                   tie_word_embeddings=False))

# stabilityai/stable-diffusion-3(.5) text_encoder/ and text_encoder_2/ config.json (CLIP ViT-L/14 and OpenCLIP
# bigG/14 with their projections; HiDream-I1's text_encoder and text_encoder_2 are the same two)
CLIP_L_PROJECTION = ("transformers.CLIPTextModelWithProjection", "transformers.CLIPTextConfig",
                     {**CLIP_L[2], "projection_dim": 768})
CLIP_G_PROJECTION = ("transformers.CLIPTextModelWithProjection", "transformers.CLIPTextConfig",
                     dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                          num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280))

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

# diffusers transformer class -> what its published pipelines hold besides the transformer, for every `--model`
# variant of the family holding that class (an entry under the variant's own name wins). Their VAEs are not
# recorded: several families ship more than one (Wan 2.2's TI2V-5B has its own).
_SD3 = {"pipeline": "StableDiffusion3Pipeline", "text_encoder": CLIP_L_PROJECTION,
        "text_encoder_2": CLIP_G_PROJECTION, "text_encoder_3": T5_XXL}
BY_TRANSFORMER: dict[str, dict] = {
    "WanTransformer3DModel": {"pipeline": "WanPipeline", "text_encoder": UMT5_XXL},
    "SkyReelsV2Transformer3DModel": {"pipeline": "SkyReelsV2Pipeline", "text_encoder": UMT5_XXL},
    "SanaTransformer2DModel": {"pipeline": "SanaPipeline", "text_encoder": GEMMA2_2B},
    "Lumina2Transformer2DModel": {"pipeline": "Lumina2Pipeline", "text_encoder": GEMMA2_2B},
    "LTX2VideoTransformer3DModel": {"pipeline": "LTX2Pipeline", "text_encoder": GEMMA3_12B},
    "CogView4Transformer2DModel": {"pipeline": "CogView4Pipeline", "text_encoder": GLM4_9B},
    "PRXTransformer2DModel": {"pipeline": "PRXPipeline", "text_encoder": T5GEMMA_2B},
    "HunyuanVideo15Transformer3DModel": {"pipeline": "HunyuanVideo15Pipeline", "text_encoder": QWEN25_VL_7B_TEXT,
                                         "text_encoder_2": BYT5_SMALL},
    "HiDreamImageTransformer2DModel": {"pipeline": "HiDreamImagePipeline", "text_encoder": CLIP_L_PROJECTION,
                                       "text_encoder_2": CLIP_G_PROJECTION, "text_encoder_3": T5_XXL,
                                       "text_encoder_4": LLAMA31_8B},
    "SD3Transformer2DModel": _SD3,
    "ZImageTransformer2DModel": {"pipeline": "ZImagePipeline", "text_encoder": QWEN3_4B},
    "Kandinsky5Transformer3DModel": {"pipeline": "Kandinsky5T2VPipeline", "text_encoder": QWEN25_VL_7B,
                                     "text_encoder_2": CLIP_L},
    "LTXVideoTransformer3DModel": {"pipeline": "LTXPipeline", "text_encoder": T5_XXL},
    "MochiTransformer3DModel": {"pipeline": "MochiPipeline", "text_encoder": T5_XXL},
    "CogVideoXTransformer3DModel": {"pipeline": "CogVideoXPipeline", "text_encoder": T5_XXL},
    "PixArtTransformer2DModel": {"pipeline": "PixArtSigmaPipeline", "text_encoder": T5_XXL},
    "CosmosTransformer3DModel": {"pipeline": "Cosmos2TextToImagePipeline", "text_encoder": T5_11B},
    "Krea2Transformer2DModel": {"pipeline": "Krea2Pipeline", "text_encoder": QWEN3_VL_4B_MODEL},
    "Ideogram4Transformer2DModel": {"pipeline": "Ideogram4Pipeline", "text_encoder": QWEN3_VL_8B_MODEL},
    "JoyImageEditTransformer3DModel": {"pipeline": "JoyImageEditPipeline", "text_encoder": QWEN3_VL_8B},
    "JoyImageEditPlusTransformer3DModel": {"pipeline": "JoyImageEditPlusPipeline", "text_encoder": QWEN3_VL_8B},
    "BriaFibo2Transformer2DModel": {"pipeline": "BriaFibo2Pipeline", "text_encoder": QWEN3_VL_4B},
    "Kandinsky6Transformer3DModel": {"pipeline": "Kandinsky6TI2VAPipeline", "text_encoder": QWEN25_VL_7B,
                                     "text_encoder_2": CLIP_L},
    "StableAudioDiTModel": {"pipeline": "StableAudioPipeline", "text_encoder": T5_BASE},
    "AceStepTransformer1DModel": {"pipeline": "AceStepPipeline", "text_encoder": QWEN3_EMBEDDING_06B},
    "LongCatAudioDiTTransformer": {"pipeline": "LongCatAudioDiTPipeline", "text_encoder": UMT5_BASE},
    # NucleusMoE-Image reads Qwen3-VL-8B's last hidden state (its joint_attention_dim, 4096); SANA-WM Gemma-2-2B's
    # (caption_channels 2304). DreamLite's pipeline holds a UNet, not a transformer: its DreamLiteTransformer2DModels
    # shard inside it (tests/families/test_dreamlite.py), the UNet as a component does not.
    "NucleusMoEImageTransformer2DModel": {"pipeline": "NucleusMoEImagePipeline", "text_encoder": QWEN3_VL_8B},
    "SanaWMTransformer3DModel": {"pipeline": "SanaWMPipeline", "text_encoder": GEMMA2_2B},
}
PIPELINES.update(BY_TRANSFORMER)
PIPELINES["qwen-image-2.1"] = {"pipeline": "QwenImage21Pipeline", "text_encoder": QWEN3_VL_8B}

SOURCES = (
    "Text encoders: the config.json of the checkpoints each pipeline's text_encoder/ holds (named beside each entry "
    "above; Mistral-Small-3.1-24B for FLUX.2-dev, Qwen3-4B/8B for FLUX.2-klein, T5-v1.1-XXL and CLIP ViT-L/14 for "
    "FLUX.1, Chroma and Bria, Qwen2.5-VL-7B for QwenImage / LongCat / HunyuanImage, llava-llama-3-8b for "
    "HunyuanVideo (its LlamaModel for text to video, the whole Llava model for image to video), SmolLM3-3B for "
    "Bria-Fibo, byT5-small for HunyuanImage's glyph encoder; UMT5-XXL for Wan and SkyReels-V2, Gemma-2-2B for Sana "
    "and Lumina2, Gemma-3-12B for LTX-2, GLM-4-9B for CogView4, T5Gemma-2B-2B's encoder for PRX, Qwen2.5-VL-7B's "
    "text model and byT5-small for HunyuanVideo-1.5, CLIP-L/bigG with projections and T5-XXL for SD3/3.5 and "
    "HiDream (plus Llama-3.1-8B-Instruct), Qwen3-4B for Z-Image, Qwen2.5-VL-7B and CLIP-L for Kandinsky 5, "
    "T5-XXL for LTX-Video, Mochi, CogVideoX and PixArt, T5-11B for Cosmos, Qwen3-VL-8B for QwenImage-2.1, "
    "JoyImage-Edit (+Plus) and Ideogram 4, Qwen3-VL-4B for Krea 2 and Bria-Fibo 2.0, Qwen2.5-VL-7B and CLIP-L for "
    "Kandinsky 6, T5-base for Stable Audio Open, Qwen3-Embedding-0.6B for ACE-Step 1.5, UMT5-base for "
    "LongCat-AudioDiT; each new one checked against its transformer's text input width, as noted beside it), written "
    "from those files, not downloaded here. Stable Audio 3's T5Gemma-B encoder is not recorded (its config.json could "
    "not be read here). VAEs: diffusers 0.42.1's class defaults (FLUX.1's 16-channel AutoencoderKL from "
    "black-forest-labs/FLUX.1-dev vae/config.json). HunyuanImage's and Bria-Fibo's VAEs (their classes have no defaults), Ovis-Image, and Motif-Video "
    "(T5Gemma2) are not recorded."
)


FAMILY = Family(name="pipelines", model_class=None, sources=SOURCES, pipelines=PIPELINES)
