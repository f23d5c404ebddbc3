"""`T5FilmDecoder` (diffusers `t5_film_transformer.py`): the `t5-film` family, the decoder of Music Spectrogram
Diffusion (a T5 decoder over spectrogram frames, conditioned on the noise time by FiLM layers).

Derived (`surgery.extend.derived_family`): the self and cross attentions are diffusers' `Attention` (q/k/v colwise,
`to_out.0` rowwise). Two things no rule reads off the model, and this file says:
- the feed-forward, `T5DenseGatedActDense` (`wo(gelu(wi_0(x)) * wi_1(x))`): wi_0 and wi_1 colwise, wo rowwise, one
  all-reduce, as a SwiGLU's;
- the FiLM layers' `scale_bias` stay whole: a modulation of the replicated conditioning embedding, whose scale and
  shift apply to the full-width normed hidden states ahead of q/k/v and the feed-forward.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor
from diffusers.models.transformers.t5_film_transformer import T5DenseGatedActDense, T5FilmDecoder, T5FiLMLayer
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.extend import Processors, TensorParallel, Tests, derived_family, register_edits, swap_rewrite

# `Attention(scale_qk=False)` runs diffusers' `AttnProcessor` (scores by `baddbmm` at scale 1; SDPA's processor would
# scale by the head size), which splits and merges heads through the module's `head_to_batch_dim` /
# `batch_to_head_dim`, by the stored head count. Its head-dim twin splits by the head size instead (the same layout:
# batch-major, then heads), and hands `get_attention_scores` the mask of the heads the rank holds:
# `prepare_attention_mask` repeated the one `(batch, queries, keys)` mask once per head, so the first ones serve.
HEAD_SIZE = "attn.inner_dim // attn.heads"
register_edits(AttnProcessor, "__call__", (
    *((f"attn.head_to_batch_dim({x})", f"{x}.unflatten(-1, (-1, {HEAD_SIZE})).transpose(1, 2).flatten(0, 1)", 1)
      for x in ("query", "key", "value")),
    ("attn.batch_to_head_dim(hidden_states)", "hidden_states.unflatten(0, (batch_size, -1)).transpose(1, 2).flatten(2)",
     1),
    ("attn.get_attention_scores(query, key, attention_mask)",
     "attn.get_attention_scores(query, key, attention_mask if attention_mask is None else "
     "attention_mask.unflatten(0, (batch_size, -1))[:, :query.shape[0] // batch_size].flatten(0, 1))", 1),
))
# a processor swapped, no weight sliced: a checkpoint is the same in both layouts
ATTENTION = replace(swap_rewrite("t5_film.attention (AttnProcessor): heads by head_dim", Attention,
                                 processors=Processors((AttnProcessor,))), in_checkpoints=False)


def t5_film_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `T5FilmDecoder.forward`, as diffusers' SpectrogramDiffusionPipeline builds them:
    `image_tokens` spectrogram frames of `input_dims`, a noise time in [0, 1), and two encodings (notes and the
    continuous context, `text_tokens` each, the second with its last two tokens masked out) cross-attended to."""
    generator = torch.Generator().manual_seed(seed)
    d_model = config.get("d_model", 768)
    masks = [torch.ones(batch, text_tokens), torch.ones(batch, text_tokens)]
    masks[1][:, -2:] = 0
    encodings = [(torch.randn(batch, text_tokens, d_model, generator=generator).to(device=device, dtype=dtype),
                  mask.to(device=device, dtype=dtype)) for mask in masks]
    return dict(
        encodings_and_masks=encodings,
        decoder_input_tokens=torch.randn(batch, image_tokens, config.get("input_dims", 128),
                                         generator=generator).to(device=device, dtype=dtype),
        decoder_noise_time=torch.rand(batch, generator=generator).to(device=device, dtype=dtype),
    )


FILM = ("the FiLM scale and shift of the replicated conditioning embedding, applied to the full-width normed "
        "hidden states ahead of the attention's q/k/v and the feed-forward: whole on every rank")

FAMILY = derived_family(
    "t5-film", T5FilmDecoder, rewrites=(ATTENTION,),
    variants={"music-spectrogram": dict(input_dims=128, targets_length=256, max_decoder_noise_time=2000.0,
                                        d_model=768, num_layers=12, num_heads=12, d_kv=64, d_ff=2048,
                                        dropout_rate=0.1)},
    sources="diffusers 0.42.1 T5FilmDecoder defaults, the values diffusers' "
    "scripts/convert_music_spectrogram_to_diffusers.py reads off MT3's base T5 config for "
    "google/music-spectrogram-diffusion (12 decoder layers, 12 heads of 64, d_model 768, mlp 2048, 128 mel bins, "
    "256 target frames); its config.json unverified here",
    default_variant="music-spectrogram",
    example_inputs=t5_film_inputs,
    tp=TensorParallel(
        plans={T5DenseGatedActDense: {"wi_0": ColwiseParallel(), "wi_1": ColwiseParallel(), "wo": RowwiseParallel()}},
        replicated={T5FiLMLayer: {"scale_bias": FILM}},
    ),
    # diffusers' SpectrogramDiffusionPipelineFastTests decoder (d_model 768, 1 layer, 1 head of 4, d_ff 2048,
    # max_decoder_noise_time 20000), shrunk: 2 layers, 4 heads of 4 (a mesh of 4 splits them), d_model 32
    tests=Tests(configs={"tiny": dict(input_dims=8, targets_length=16, max_decoder_noise_time=20000.0, d_model=32,
                                      num_layers=2, num_heads=4, d_kv=4, d_ff=64, dropout_rate=0.1)}),
)
