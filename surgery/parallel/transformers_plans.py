"""transformers' own tensor-parallel plans, as stock torch styles.

transformers ships a plan with many of its models: `config.base_model_tp_plan` (`"layers.*.self_attn.q_proj":
"colwise"`), merged by each model's `post_init` into `model._tp_plan` with its submodules' prefixes
(`"model.language_model.layers.*..."`, `"lm_head"`). transformers applies those names with its own style classes
(`transformers.distributed.tensor_parallel`); here each name becomes the stock `torch.distributed.tensor.parallel`
style that does the same, so that `surgery.tensor_parallel` shards a text encoder with the same machinery as a
diffusers transformer (checks, rank agreement, `src_data_rank`, sharded loading). This module names no model family:
it reads whatever plan the model carries.
"""

from __future__ import annotations

import re
from typing import Callable

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from surgery.core.errors import SurgeryError
from surgery.core.checks import mesh_sizes_dividing


def _replicated_with_grad_allreduce() -> ParallelStyle:
    # A norm over the last dim of per-head features (Qwen3's q_norm / k_norm on [batch, seq, heads, head_dim]): the
    # weight stays whole, the input is declared sharded on the heads dim (-2), so that the weight's gradient is summed
    # over ranks, as transformers' `ReplicatedWithGradAllReduce` does with a hook. No collective runs in forward.
    return SequenceParallel(sequence_dim=-2, use_local_output=True)


# transformers' style name -> the stock style doing the same (transformers' own definitions, in
# `transformers/distributed/tensor_parallel.py`, are mostly these very classes with the same layouts).
STOCK_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    # vocabulary-parallel embedding: each rank looks up its rows of the vocabulary, the partial lookups are summed
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicated_with_grad_allreduce": _replicated_with_grad_allreduce,
}


def transformers_tp_plan(model: nn.Module) -> dict[str, str]:
    """The plan a transformers model carries (`model._tp_plan`, merged from its configs), or `{}`."""
    plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict) or not type(model).__module__.startswith("transformers."):
        return {}
    return dict(plan)


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"[^.]+") + r"\Z")


def stock_plan(model: nn.Module, skip: Callable[[str], bool] = lambda path: False) -> list[tuple[str, nn.Module, dict]]:
    """`(parent path, parent module, {child: stock style})` for each module transformers' plan names in `model`.

    Entries are grouped by the parent of the planned module (`layers.3.self_attn` -> `{"q_proj": ...}`), as the
    registered per-class plans are. `skip(path)` drops modules already covered by a registered plan. Parameters
    shared by two modules (tied input and output embeddings) are left whole: sharding one would untie them; so are
    embeddings of a subclass (Gemma's scaled ones). A style
    name without a stock equivalent is an error naming it.
    """
    plan = transformers_tp_plan(model)
    if not plan:
        return []
    patterns = [(_pattern(key), key, style) for key, style in plan.items()]
    chosen: list[tuple[str, nn.Module, str]] = []
    for path, module in model.named_modules():
        if not path or skip(path):
            continue
        for regex, key, style in patterns:
            if regex.match(path):
                chosen.append((path, module, style))
                break
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    tied = {p for paths in owners.values() if len(set(paths)) > 1 for p in paths}
    grouped: dict[str, dict[str, ParallelStyle]] = {}
    for path, module, style in chosen:
        if path in tied:
            continue
        if isinstance(module, nn.Embedding) and type(module) is not nn.Embedding:
            # Gemma's embedding scales its lookup in its own forward: left whole, like any layer that is not the
            # stock class the stock styles were written for
            continue
        if style not in STOCK_STYLES:
            raise SurgeryError(
                f"surgery.tensor_parallel: transformers' plan shards '{path}' with style {style!r}, which has no stock "
                f"torch equivalent here (known: {', '.join(sorted(STOCK_STYLES))}). Give "
                f"{type(module).__name__}'s parent a plan (surgery.extend.TensorParallel(plans=...) in a family, "
                "surgery.extend.register_family), or pass plan=."
            )
        parent, _, child = path.rpartition(".")
        grouped.setdefault(parent, {})[child] = STOCK_STYLES[style]()
    return [(parent, model.get_submodule(parent), entries) for parent, entries in grouped.items()]


def check_heads(module: nn.Module, path: str, world: int) -> None:
    """Whole heads on each rank: a transformers attention module's config must split over the mesh."""
    config = getattr(module, "config", None)
    if config is None or not (hasattr(module, "head_dim") or hasattr(module, "key_value_proj_dim")):
        return
    for name in ("num_attention_heads", "num_key_value_heads", "num_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % world:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path or type(module).__name__}' has {name}={heads}, which a mesh of "
                f"{world} cannot split into whole heads. Use a mesh size that divides {heads}: "
                f"{mesh_sizes_dividing(heads)}."
            )


def checkpoint_renames(model: nn.Module, stored: set[str]) -> dict[str, str]:
    """Stored name -> model name for a transformers model's checkpoint, by transformers' own key renamings
    (`conversion_mapping`: `language_model.model.layers...` -> `model.language_model.layers...`); `{}` for other
    models. A tensor that transformers converts on load (concatenates, splits) rather than renames is an error: only
    renamed tensors can be read slice by slice."""
    if not type(model).__module__.startswith("transformers."):
        return {}
    from transformers.conversion_mapping import get_model_conversion_mapping  # lazy: optional
    from transformers.core_model_loading import WeightRenaming, rename_source_key  # lazy: optional

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = dict.fromkeys(name for name, _ in model.named_parameters())
    meta.update(dict.fromkeys(name for name, _ in model.named_buffers()))
    names = {}
    for key in stored:
        renamed, converted = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                               meta)
        if converted is not None:
            raise SurgeryError(
                f"load_tensor_parallel: transformers converts checkpoint tensor {key!r} on load ({converted!r}), "
                "which cannot be read slice by slice. Load the model with from_pretrained, then call "
                "surgery.tensor_parallel."
            )
        names[key] = renamed
    return names
