"""Tiny seeded text encoders of every supported family's pipelines (the classes diffusers' pipelines hold), built
offline from transformers' configs; and one layer of each at published width."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB = 320  # divides by 2, 4 and 8: the vocabulary-parallel embeddings split evenly
LM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
          num_key_value_heads=4, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def _seeded(model: nn.Module, seed: int) -> nn.Module:
    """Every weight drawn from `seed` (norm scales near 1, not at their init), float32, eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype)
            if param.dim() > 1:
                param.copy_(noise * param.shape[-1] ** -0.5)
            else:
                param.copy_(1.0 + 0.1 * noise)
    return model.eval()


def mistral3(seed: int = 0, **text):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8)
    config = Mistral3Config(text_config=MistralConfig(**{**LM, **text}), vision_config=vision)
    return _seeded(Mistral3ForConditionalGeneration(config), seed)


def qwen3_causal(seed: int = 0, **text):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _seeded(Qwen3ForCausalLM(Qwen3Config(**{**LM, **text})), seed)


def qwen3_model(seed: int = 0, **text):
    from transformers import Qwen3Config, Qwen3Model

    return _seeded(Qwen3Model(Qwen3Config(**{**LM, **text})), seed)


def qwen25_vl(seed: int = 0, **text):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_config = {**LM, "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2],
                                             "rope_theta": 10000.0}, **text}
    text_config.pop("head_dim")
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    return _seeded(Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text_config,
                                                                        vision_config=vision)), seed)


def llama(seed: int = 0, **text):
    from transformers import LlamaConfig, LlamaModel

    return _seeded(LlamaModel(LlamaConfig(**{**LM, **text})), seed)


def llava(seed: int = 0, **text):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=16)
    config = LlavaConfig(text_config=LlamaConfig(**{**LM, **text}), vision_config=vision, image_token_index=VOCAB - 1)
    return _seeded(LlavaForConditionalGeneration(config), seed)


def smollm3(seed: int = 0, **text):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    return _seeded(SmolLM3ForCausalLM(SmolLM3Config(**{**LM, "pad_token_id": 0, **text})), seed)


def t5(seed: int = 0, **overrides):
    from transformers import T5Config, T5EncoderModel

    config = dict(vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=96, num_layers=2, num_heads=8,
                  feed_forward_proj="gated-gelu", relative_attention_num_buckets=16, dropout_rate=0.0)
    return _seeded(T5EncoderModel(T5Config(**{**config, **overrides})), seed)


def t5_plain(seed: int = 0):
    """Original T5 (ReLU, one `wi`): byT5-small, HunyuanImage's glyph encoder, is gated; this covers the other MLP."""
    return t5(seed, feed_forward_proj="relu")


# name -> (builder, pipelines holding that class)
ENCODERS = {
    "mistral3": (mistral3, "Flux2Pipeline (FLUX.2-dev)"),
    "qwen3_causal": (qwen3_causal, "Flux2KleinPipeline"),
    "qwen3_model": (qwen3_model, "OvisImagePipeline, AceStepPipeline (Qwen3-Embedding)"),
    "qwen25_vl": (qwen25_vl, "QwenImagePipeline, LongCatImagePipeline, HunyuanImagePipeline, Kandinsky6TI2VAPipeline"),
    "llama": (llama, "HunyuanVideoPipeline"),
    "llava": (llava, "HunyuanVideoImageToVideoPipeline"),
    "smollm3": (smollm3, "BriaFiboPipeline"),
    "t5": (t5, "FluxPipeline, ChromaPipeline, BriaPipeline, HunyuanImagePipeline (byT5)"),
    "t5_plain": (t5_plain, "T5 v1.0 MLP: StableAudioPipeline (t5-base)"),
}


def ids(batch: int = 2, length: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB - 2, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(tokens)
    mask[1, length - 3:] = 0
    return tokens, mask


def outputs(encoder: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Every hidden state (what the pipelines pick from) and the logits where the model computes them."""
    with torch.no_grad():
        out = encoder(input_ids=tokens, attention_mask=mask, output_hidden_states=True)
    found = list(out.hidden_states)
    for pooled in ("logits", "pooler_output", "text_embeds"):  # CLIP's pooled outputs: SD3 and HiDream read them
        if getattr(out, pooled, None) is not None:
            found.append(getattr(out, pooled))
    return [t.full_tensor() if hasattr(t, "full_tensor") else t for t in found]


PUBLISHED_VOCAB = 2048  # the vocabulary is cut (its width kept): the embedding and lm_head would cost 2.7 GB a rank


def published_layer(name: str, seed: int = 0) -> nn.Module:
    """One layer of a published encoder at its published width, bf16, from `rewrites/pipelines.py`'s configs."""
    import importlib

    from surgery_rewrites import pipelines
    from surgery.core.build import default_dtype

    spec = {"mistral3": pipelines.MISTRAL_SMALL_3_1, "t5_xxl": pipelines.T5_XXL, "umt5_xxl": pipelines.UMT5_XXL,
            "qwen25_vl_text": pipelines.QWEN25_VL_7B}[name]
    cls_name, config_name, config = spec
    config = {**config}
    if name == "mistral3":
        config["text_config"] = {**config["text_config"], "num_hidden_layers": 1, "vocab_size": PUBLISHED_VOCAB}
        config["vision_config"] = {**config["vision_config"], "num_hidden_layers": 1, "hidden_size": 64,
                                   "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 32}
    elif name in ("t5_xxl", "umt5_xxl"):
        config.update(num_layers=1, vocab_size=PUBLISHED_VOCAB)
    else:  # Qwen2.5-VL's text model alone
        cls_name, config_name = "transformers.Qwen2_5_VLTextModel", "transformers.Qwen2_5_VLTextConfig"
        config = {**config["text_config"], "num_hidden_layers": 1, "vocab_size": PUBLISHED_VOCAB}

    def load(qualified: str):
        module, _, attr = qualified.rpartition(".")
        return getattr(importlib.import_module(module), attr)

    from accelerate import init_empty_weights

    # parameters on meta (every one is drawn below), buffers (rotary frequencies) computed for real
    with default_dtype(torch.bfloat16), init_empty_weights(include_buffers=False):
        model = load(cls_name)(load(config_name)(**config))
    generator = torch.Generator().manual_seed(seed)
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        value = torch.empty(param.shape, dtype=torch.float32).uniform_(-1.0, 1.0, generator=generator)
        value = value * (3 / param.shape[-1]) ** 0.5 if param.dim() > 1 else 1.0 + 0.1 * value
        setattr(model.get_submodule(owner), leaf, nn.Parameter(value.to(torch.bfloat16), requires_grad=False))
    return model.eval()


# --- the text encoders of the DiTs covered in the fourth round (one world-2 job: tests/parallel/test_text_encoders.py) ------

def umt5(seed: int = 0, **overrides):
    from transformers import UMT5Config, UMT5EncoderModel

    config = dict(vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=96, num_layers=2, num_heads=8,
                  feed_forward_proj="gated-gelu", relative_attention_num_buckets=16, dropout_rate=0.0)
    return _seeded(UMT5EncoderModel(UMT5Config(**{**config, **overrides})), seed)


def _clip_config(**overrides):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(**{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=8, max_position_embeddings=32, projection_dim=48,
                                    bos_token_id=0, eos_token_id=VOCAB - 1), **overrides})


def clip(seed: int = 0, **overrides):
    from transformers import CLIPTextModel

    return _seeded(CLIPTextModel(_clip_config(**overrides)), seed)


def clip_projection(seed: int = 0, **overrides):
    from transformers import CLIPTextModelWithProjection

    return _seeded(CLIPTextModelWithProjection(_clip_config(hidden_act="gelu", **overrides)), seed)


def gemma2(seed: int = 0, **text):
    from transformers import Gemma2Config, Gemma2Model

    return _seeded(Gemma2Model(Gemma2Config(**{**LM, "pad_token_id": 0, "sliding_window": 4, **text})), seed)


def gemma3(seed: int = 0, **text):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    text_config = Gemma3TextConfig(**{**LM, "pad_token_id": 0, "sliding_window": 4, **text})
    config = Gemma3Config(text_config=text_config, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)
    return _seeded(Gemma3ForConditionalGeneration(config), seed)


def glm(seed: int = 0, **text):
    from transformers import GlmConfig, GlmModel

    return _seeded(GlmModel(GlmConfig(**{**LM, "pad_token_id": 0, **text})), seed)


def t5gemma(seed: int = 0, **text):
    from transformers import T5GemmaConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    module = {**LM, "pad_token_id": 0, "sliding_window": 4, **text}
    config = T5GemmaConfig(encoder=module, decoder=module, dropout_rate=0.0, attention_dropout=0.0)
    return _seeded(T5GemmaEncoder(config.encoder), seed)


def qwen3_vl(seed: int = 0, **text):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text_config = {**LM, "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2],
                                             "rope_theta": 10000.0}, **text}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  deepstack_visual_indexes=[0], num_position_embeddings=16)
    return _seeded(Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text_config, vision_config=vision)),
                   seed)


def qwen3_vl_model(seed: int = 0, **text):
    """The model without its language head (Krea 2 and Ideogram 4 hold `Qwen3VLModel`)."""
    return qwen3_vl(seed, **text).model


def qwen25_vl_text(seed: int = 0, **text):
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    config = {**LM, "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
              **text}
    config.pop("head_dim")
    return _seeded(Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**config)), seed)


def llama_causal(seed: int = 0, **text):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(LlamaForCausalLM(LlamaConfig(**{**LM, **text})), seed)


# name -> (builder, pipelines holding that class)
DIT_ENCODERS = {
    "umt5": (umt5, "WanPipeline (and Wan's I2V, VACE, Animate), SkyReelsV2Pipeline, LongCatAudioDiTPipeline"),
    "clip": (clip, "Kandinsky5T2VPipeline and Kandinsky6TI2VAPipeline (text_encoder_2), FluxPipeline, "
                   "HunyuanVideoPipeline"),
    "clip_projection": (clip_projection, "StableDiffusion3Pipeline, HiDreamImagePipeline (CLIP-L and bigG)"),
    "gemma2": (gemma2, "SanaPipeline, Lumina2Pipeline"),
    "gemma3": (gemma3, "LTX2Pipeline"),
    "glm": (glm, "CogView4Pipeline"),
    "t5gemma": (t5gemma, "PRXPipeline"),
    "qwen3_vl": (qwen3_vl, "QwenImage21Pipeline, JoyImageEdit(Plus)Pipeline, BriaFibo2Pipeline"),
    "qwen3_vl_model": (qwen3_vl_model, "Krea2Pipeline, Ideogram4Pipeline"),
    "qwen25_vl_text": (qwen25_vl_text, "HunyuanVideo15Pipeline"),
    "llama_causal": (llama_causal, "HiDreamImagePipeline (text_encoder_4)"),
}
