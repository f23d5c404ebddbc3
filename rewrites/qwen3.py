"""Qwen3 (transformers), the text encoder of FLUX.2-klein: its projections are already separate, so it needs no
rewrite, and transformers ships its tensor-parallel plan (`Qwen3Config.base_model_tp_plan`: q/k/v/gate/up colwise,
o/down rowwise, the QK-norms replicated with their gradients summed, the embedding vocabulary-parallel), which
`surgery.tensor_parallel` applies as stock styles (`surgery.parallel.transformers_plans`). Nothing is planned here: this file
only names the model class, so that the registry knows it. Nothing here imports transformers."""

from __future__ import annotations

from surgery.extend import Family

_MODELING = "transformers.models.qwen3.modeling_qwen3"

FAMILY = Family(name="qwen3", model_class=f"{_MODELING}.Qwen3Model")
