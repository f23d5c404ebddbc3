"""Model families from data: a family file lists a diffusers model's published configs, tiny test configs and
example inputs; its rewrites, plans and all-reduce count are derived (`surgery.parallel.derive`)."""

from __future__ import annotations

import functools
import sys
from dataclasses import replace

import torch
import torch.fx.experimental._config
import torch.nn as nn
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel

from surgery.core.build import build, keep_in_fp32
from surgery.core.leaves import Processors, rule_edits, swap_rewrite
from surgery.core.norms import elementwise_norm
from surgery.core.registry import Family, Rewrite, TensorParallel
from surgery.core.rewrite import unfuse
from surgery.parallel.derive import QK_NORMS, AcrossHeadsNorm
from surgery.parallel.dtensor_attention import ImplicitReplication
from surgery.parallel.plans import planned_for


def model_processors(model_class: type[nn.Module]) -> tuple[type, ...]:
    """The attention processor classes defined in a model's own file (diffusers writes a model's processors next to
    it when its attention is the shared `Attention`, which lists no `_available_processors` of its own)."""
    home = sys.modules[model_class.__module__]
    return tuple(obj for name, obj in vars(home).items() if isinstance(obj, type) and "Processor" in name
                 and obj.__module__ == home.__name__ and "__call__" in vars(obj))


@functools.cache  # one rewrite per class, shared by the families that hold it
def attention_rewrite(cls: type[nn.Module], extra: tuple[type, ...] = ()) -> Rewrite | None:
    """The unfuse rewrite a diffusers attention class needs for its derived plan: its processors (its
    `_available_processors`, and `extra`) that reshape by the stored head count run their head-dim twins (the
    processor rule), and its `torch.nn.RMSNorm` q/k norms compute in elementwise ops (`ElementwiseRMSNorm`: a norm
    across heads shards by its statistic). None where it needs none."""
    candidates = tuple(dict.fromkeys((*getattr(cls, "_available_processors", ()), *extra)))
    processors = tuple(p for p in candidates if rule_edits(p) is not None)
    if not processors:
        return None
    # named by the file of the processors it swaps (diffusers copies a class, `WanAttention`, into other models' files);
    # processors of diffusers' shared file are named one by one (families set different sets of them on `Attention`)
    where = (extra[0] if extra else cls).__module__.rpartition('.')[2]
    if where == "attention_processor":
        where = ", ".join(p.__name__ for p in processors)
    rewrite = swap_rewrite(f"{cls.__name__} ({where}): heads by head_dim", cls, processors=Processors(processors),
                           children=dict.fromkeys(QK_NORMS, elementwise_norm))
    # processors and norm classes swapped, no weight sliced: a checkpoint is the same in both layouts
    return replace(rewrite, in_checkpoints=False)


def derived_all_reduces(family: Family, config: dict) -> int:
    """All-reduces one forward makes under the derived plan: one per rowwise Linear and per norm across heads (each
    runs once per forward in these DiTs), read off the model built from `config` on meta."""
    # built as given (not through `model_on_meta`'s user-config check): a published-width slice may hold no
    # double-stream blocks (num_layers=0)
    with torch.device("meta"):
        model = unfuse(keep_in_fp32(build(family, config)))
    styled = [(_sub(model, path, key), all_reduces(style)) for path, _, plan in planned_for(model)
              for key, style in plan.items()]
    calls = _calls_on_meta(family, config, model, [m for m, n in styled if n])
    # a planned module the forward never calls (the audio stream SANA-WM's refiner keeps for its checkpoint) makes none
    return sum(n * (calls.get(id(m), 0) if calls is not None else 1) for m, n in styled)


def _sub(model: nn.Module, path: str, key: str) -> nn.Module:
    return model.get_submodule(".".join(p for p in (path, key) if p))


def _calls_on_meta(family: Family, config: dict, model: nn.Module, modules: list) -> dict | None:
    """How often one forward calls each of `modules` (a block may run one feed-forward on both streams), read off a
    forward on meta of the family's example inputs; None where the family has none or the forward needs real
    values (then each is taken as called once)."""
    if family.example_inputs is None or not modules:
        return None
    calls: dict = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.__setitem__(id(mod), calls.get(id(mod), 0) + 1))
             for m in modules]
    try:
        # a boolean mask index (`x[drop] *= 0`) runs `nonzero`, which meta tensors refuse by default: its count of
        # elements, not its values, is all a count of module calls needs
        with torch.no_grad(), torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
            model(**family.example_inputs(config, device="meta"))
    except Exception:  # noqa: BLE001 - a forward that needs real values (.item(), data-dependent shapes)
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def all_reduces(style) -> int:
    """The all-reduces one call of a module under `style` makes: a rowwise Linear that replicates its output, a
    module output resolved from partial sums, a norm across heads (its statistic)."""
    if isinstance(style, RowwiseParallel):
        return int(all(p.is_replicate() for p in style.output_layouts))
    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_output
    if isinstance(style, PrepareModuleOutput):  # one per output resolved from partial sums
        return sum(1 for have, want in zip(style.output_layouts, style.desired_output_layouts)
                   if have is not None and have.is_partial() and want is not None and want.is_replicate())
    if isinstance(style, ImplicitReplication):  # a MoE layer: its routed and shared experts' sum, resolved once
        return int(style.sum_output)
    return style.statistics if isinstance(style, AcrossHeadsNorm) else 0


def derived_family(name: str, model_class: type[nn.Module], *, attention: tuple[type[nn.Module], ...] = (),
                   processors: tuple[type, ...] = (), rewrites: tuple[Rewrite, ...] = (),
                   tp: TensorParallel = TensorParallel(), **fields) -> Family:
    """A `Family` whose rewrites and plans are derived: `attention` lists the model's attention classes (their
    rewrites from `attention_rewrite`, with the stock `processors` the model sets where a class lists none, else the
    processors defined in the model's own file); `rewrites` adds those no rule derives (a fused weight's unfused
    leaves: which columns read the attention, which rows are which projection, are the family's data); `tp` holds
    what the derivation cannot know (replicated Linears, rotary inputs, plans of its own); `fields` are `Family`'s
    other fields (variants, sources, example inputs, tests). Its plans are derived from the unfused modules and its
    all-reduce count is read off them."""
    rewrites = tuple(r for r in (attention_rewrite(cls, processors or (
        () if hasattr(cls, "_available_processors") else model_processors(model_class))) for cls in attention)
        if r is not None) + tuple(rewrites)
    holder: list[Family] = []
    family = Family(name=name, model_class=model_class, rewrites=rewrites, **fields,
                    tp=replace(tp, all_reduces=tp.all_reduces or (lambda config: derived_all_reduces(holder[0], config))))
    holder.append(family)
    return family
