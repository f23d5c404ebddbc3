"""CLIP (transformers), the text encoder beside FLUX.1's T5 and HunyuanVideo's Llama, both of SD3's and HiDream's
(CLIP-L and OpenCLIP bigG, `CLIPTextModelWithProjection`) and Kandinsky 5's: transformers ships no tensor-parallel plan
for it, so this is a literal stock one. Keyed by qualified class name: nothing here imports transformers.

The attention views q/k/v with -1 heads (`(*input_shape, -1, head_dim)`), so it runs on each rank's heads as it is.
The same classes make CLIP's vision towers (Llava's, in HunyuanVideo's image-to-video encoder): those stay whole, as
every vision tower of a text encoder does here (the plan applies where the module's config is a `CLIPTextConfig`;
a tower's heads need not divide the mesh the language model splits over). The token and position embeddings,
the final norm and the projection of the pooled token stay whole. Heads the mesh cannot split (CLIP-L's 12 or bigG's
20 over 8 ranks) are refused by transformers' config check, and the pipeline keeps that encoder whole.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.extend import Family, TensorParallel

_MODELING = "transformers.models.clip.modeling_clip"

ATTENTION_TP_PLAN = {
    "q_proj": ColwiseParallel(),
    "k_proj": ColwiseParallel(),
    "v_proj": ColwiseParallel(),
    "out_proj": RowwiseParallel(),
}
MLP_TP_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}



def _text_model(module: nn.Module) -> bool:
    return type(getattr(module, "config", None)).__name__ == "CLIPTextConfig"


FAMILY = Family(
    name="clip",
    model_class=f"{_MODELING}.CLIPTextModel",
    tp=TensorParallel(
        plans={f"{_MODELING}.CLIPAttention": ATTENTION_TP_PLAN, f"{_MODELING}.CLIPMLP": MLP_TP_PLAN},
        when={f"{_MODELING}.CLIPAttention": _text_model, f"{_MODELING}.CLIPMLP": _text_model},
    ),
)
