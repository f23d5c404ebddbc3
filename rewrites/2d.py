"""`Transformer2DModel` (diffusers `transformer_2d.py`): the `transformer-2d` family, diffusers' generic 2-D
transformer as DiT's checkpoints declare it (facebook/DiT-XL-2-256's transformer/config.json names this class; its
`from_pretrained` hands back the `dit` family's `DiTTransformer2DModel` for `norm_type="ada_norm_zero"`, a model built
from the config keeps this class).

Derived (`surgery.extend.derived_family`), as the `dit` family: the same `BasicTransformerBlock`s, whose processors
reshape by the stored head count in the older spelling, which the processor rule of `surgery.core.leaves` reads.
"""

from __future__ import annotations

from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC
from surgery_rewrites.dit import dit_inputs

# DiTTransformer2DModel's defaults, spelled out: Transformer2DModel's own differ (GEGLU, layer norm, no patches)
DIT = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
           attention_bias=True, patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
           norm_type="ada_norm_zero", norm_elementwise_affine=False, norm_eps=1e-5)

FAMILY = derived_family(
    "transformer-2d", Transformer2DModel, attention=(Attention,), processors=GENERIC,
    variants={"dit-xl-2-256": {**DIT, "sample_size": 32}, "dit-xl-2-512": {**DIT, "sample_size": 64}},
    sources="the transformer/config.json of facebook/DiT-XL-2-256 and -512 as diffusers' "
    "scripts/convert_dit_to_diffusers.py wrote them (class Transformer2DModel: 28 layers, 16 heads of 72, "
    "gelu-approximate, ada_norm_zero, out_channels 8, sample_size image_size // 8)",
    default_variant="dit-xl-2-256",
    example_inputs=dit_inputs,
    # the dit family's tiny config, as a Transformer2DModel
    tests=Tests(configs={"tiny": {**DIT, "num_attention_heads": 4, "attention_head_dim": 8, "num_layers": 2,
                                  "sample_size": 8, "num_embeds_ada_norm": 10}}),
)
