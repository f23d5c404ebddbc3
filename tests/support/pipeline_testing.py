"""Tiny FLUX.2-klein pipelines built offline: seeded transformer, VAE and Qwen3 text encoder, a BPE tokenizer."""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinKVPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
)

from surgery_rewrites.flux2 import seeded_model

TEXT_LAYERS = (1, 2, 3)
HIDDEN = 32
CORPUS = ["a red fox in fresh snow", "a lighthouse on a cliff at dusk", "an oil painting of a quiet harbour",
          "user assistant system", "photo of a cat sitting on a chair"] * 4
# message content as a string (Klein) or as a list of typed parts (FLUX.2-dev's Mistral format)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer():
    """A byte-level BPE trained here on a few sentences, in the Qwen2 tokenizer class, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    wrapped = Qwen2TokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token=None, bos_token=None)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def text_encoder(vocab_size: int, seed: int = 0, heads: int = 4, kv_heads: int = 2, layers: int = len(TEXT_LAYERS)):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


def vae(seed: int = 0) -> AutoencoderKLFlux2:
    torch.manual_seed(seed)
    model = AutoencoderKLFlux2(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=32,
    )
    return model.eval()


TRANSFORMER = dict(in_channels=16, num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=16,
                   joint_attention_dim=len(TEXT_LAYERS) * HIDDEN, timestep_guidance_channels=32,
                   axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)


def klein_pipeline(seed: int = 0, kv: bool = False, text_layers: int = len(TEXT_LAYERS)):
    """A Flux2KleinPipeline (or the Klein KV pipeline) of tiny seeded components; no downloads.

    `text_layers=27` gives an encoder deep enough for the pipeline's default `text_encoder_out_layers` (9, 18, 27).
    """
    tok = tokenizer()
    cls = Flux2KleinKVPipeline if kv else Flux2KleinPipeline
    return cls(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift_terminal=None),
        vae=vae(seed),
        text_encoder=text_encoder(len(tok), seed, layers=text_layers),
        tokenizer=tok,
        transformer=seeded_model(TRANSFORMER, seed),
    )


def mistral3_text_encoder(vocab_size: int, seed: int = 0):
    """A tiny Mistral3 (FLUX.2-dev's text encoder class): 3 text layers, a one-layer Pixtral vision tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    torch.manual_seed(seed)
    text = MistralConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=len(TEXT_LAYERS), num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=256)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8)
    return Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision)).eval()


def dev_pipeline(seed: int = 0) -> Flux2Pipeline:
    """A Flux2Pipeline (FLUX.2-dev: guidance-embedded transformer, Mistral3 encoder) of tiny seeded components."""
    tok = tokenizer()
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=vae(seed),
        text_encoder=mistral3_text_encoder(len(tok), seed),
        tokenizer=tok,
        transformer=seeded_model(dict(TRANSFORMER, guidance_embeds=True), seed),
    )


def generate(pipe, prompt: str = "a red fox in fresh snow", seed: int = 0, **kwargs) -> torch.Tensor:
    return pipe(
        prompt=prompt, height=32, width=32, num_inference_steps=2, generator=torch.Generator().manual_seed(seed),
        max_sequence_length=kwargs.pop("max_sequence_length", 16), text_encoder_out_layers=TEXT_LAYERS, output_type="pt", **kwargs,
    ).images


def psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    mse = (image.double() - reference.double()).square().mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()
