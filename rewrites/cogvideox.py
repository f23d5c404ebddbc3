"""`CogVideoXTransformer3DModel` (diffusers `cogvideox_transformer_3d.py`): the `cogvideox` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its processors reshape
by the stored head count in the older spelling (`head_dim = inner_dim // attn.heads`), which the processor rule of
`surgery.core.leaves` reads.
"""

from __future__ import annotations

from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXTransformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cogvideox_inputs


FAMILY = derived_family(
    "cogvideox", CogVideoXTransformer3DModel, attention=(Attention,), processors=GENERIC,
    variants={
        "2b": {"num_layers": 30, "num_attention_heads": 30, "use_rotary_positional_embeddings": False},
        "5b": {"num_layers": 42, "num_attention_heads": 48, "use_rotary_positional_embeddings": True},
    },
    sources="diffusers scripts/convert_cogvideox_to_diffusers.py (--num_layers / --num_attention_heads / "
    "--use_rotary_positional_embeddings for CogVideoX-2b: 30 / 30 / no, CogVideoX-5b: 42 / 48 / yes; the rest "
    "get_transformer_init_kwargs('1.0') and the class defaults)",
    default_variant="5b",
    example_inputs=cogvideox_inputs,
    tests=Tests(configs={
        "tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=16,
                     text_embed_dim=16, num_layers=2, sample_width=4, sample_height=4, sample_frames=5,
                     max_text_seq_length=8),
        # CogVideoX-5b's RoPE: sharded under no_grad only (tests/families/test_cogvideox.py): under autograd torch
        # refuses the processor's in-place write of the rotated q/k into the per-head norm's output (a view
        # DTensor's to_local returns). The 3D RoPE splits head_dim in quarters and eighths, each even: 16 at least
        "tiny_rope": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                          time_embed_dim=16, text_embed_dim=16, num_layers=2, sample_width=4, sample_height=4,
                          sample_frames=5, max_text_seq_length=8, use_rotary_positional_embeddings=True),
    }),
)
