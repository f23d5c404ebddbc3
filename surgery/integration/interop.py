"""diffusers interop kept out of the rewrite engine: what the public verbs tell diffusers once modules are swapped.

The model's `_tp_plan` (what diffusers' own `enable_parallelism` reads) is made to fit its current modules, and
`surgery.integration.diffusers_hooks` keeps `save_pretrained`, `load_state_dict` and the LoRA loaders in diffusers' layout.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from surgery.core.registry import registered
from surgery.integration import diffusers_hooks
from surgery.integration.diffusers_hooks import _is_diffusers_model
from surgery.parallel.plans import block_path, planned_modules
from surgery.core.walk import find_modules

# The class-name lists diffusers' features read: regional compile (`compile_repeated_blocks`) and device maps.
BLOCK_NAME_LISTS = ("_repeated_blocks", "_no_split_modules")


def keep_diffusers_in_step(model: nn.Module) -> nn.Module:
    """Fit diffusers' plan, block-name lists and checkpoint hooks to `model`'s current modules; returns `model`.

    Called by the public verbs that swap modules (`surgery.unfuse`, `fuse`, `load_tensor_parallel`,
    `tensor_parallel_pipeline`) once they are done: the core below them knows nothing of diffusers' bookkeeping."""
    sync_diffusers_tp_plans(model)
    sync_block_names(model)
    diffusers_hooks.install(model)
    return model


def _style_name(style: ParallelStyle) -> str | None:
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    return None


def diffusers_tp_plan(model: nn.Module) -> dict[str, str]:
    """The flat `_tp_plan` diffusers' `enable_parallelism` reads, for `model`'s current modules.

    Plain "colwise"/"rowwise" entries only: diffusers' format has no partial outputs, so a single-stream block then
    all-reduces twice (attention and MLP outputs) where `tensor_parallel` all-reduces once.
    """
    flat: dict[str, str] = {}
    for path, _, plan in planned_modules(model):
        block, in_list = block_path(model, path)
        prefix = f"{block.rpartition('.')[0]}.*" if in_list else block
        for key, style in plan.items():
            name = _style_name(style)
            if name is not None:
                flat[".".join(p for p in (prefix, path[len(block) :].lstrip("."), key) if p)] = name
    return flat


def sync_diffusers_tp_plans(model: nn.Module) -> None:
    """Give each diffusers model in `model` that holds unfused modules an instance `_tp_plan` that fits them.

    A model back in fused form loses the override and reads its class's packed plan again.
    """
    for module in model.modules():
        # diffusers' models only: a transformers model's instance `_tp_plan` is its own (merged from its configs by
        # `post_init`), which `tensor_parallel` reads; popping it would leave the class's `lm_head` entry alone
        if not _is_diffusers_model(module) or getattr(type(module), "_tp_plan", None) is None:
            continue
        if find_modules(module, fused=False):
            module._tp_plan = diffusers_tp_plan(module)
        else:
            vars(module).pop("_tp_plan", None)


def sync_block_names(model: nn.Module) -> None:
    """Where a rewrite's unfused form is a class of its own (a stock forward that cannot run the leaves), name it
    beside the stock class in each diffusers model's `_repeated_blocks` and `_no_split_modules` (instance attributes,
    like `_tp_plan`), so regional compile and device maps still find every block; a model with none of them left
    reads its class's lists again. Rewrites that keep the stock class need nothing here.
    """
    renamed = {r.fused.__name__: r.unfused for r in registered() if r.unfused is not r.fused}
    if not renamed:
        return
    for module in model.modules():
        cls = type(module)
        # diffusers' models only: a transformers model's instance lists are its own (`post_init` sets them)
        if not _is_diffusers_model(module) or not any(getattr(cls, attr, None) for attr in BLOCK_NAME_LISTS):
            continue
        present = {type(m).__name__ for m in module.modules()}
        for attr in BLOCK_NAME_LISTS:
            stock = list(getattr(cls, attr, None) or [])
            names = stock + [renamed[n].__name__ for n in stock if n in renamed and renamed[n].__name__ in present]
            if names != stock:
                setattr(module, attr, names)
            else:
                vars(module).pop(attr, None)

