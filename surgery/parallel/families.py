"""Model families from data: a family file lists a diffusers model's published configs, tiny test configs and
example inputs; its rewrites, plans and all-reduce count are derived (`surgery.parallel.derive`)."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch.nn as nn
from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel

from surgery.core.build import model_on_meta
from surgery.core.leaves import Processors, rule_edits, swap_rewrite
from surgery.core.norms import elementwise_norm
from surgery.core.registry import Family, Rewrite
from surgery.core.rewrite import unfuse
from surgery.parallel.derive import QK_NORMS, AcrossHeadsNorm
from surgery.parallel.plans import planned_for


@functools.cache  # one rewrite per class, shared by the families that hold it
def attention_rewrite(cls: type[nn.Module], processors: tuple[type, ...] = ()) -> Rewrite | None:
    """The unfuse rewrite a diffusers attention class needs for its derived plan: its processors that reshape by the
    stored head count run their head-dim twins (the processor rule), and its `torch.nn.RMSNorm` q/k norms compute in
    elementwise ops (`ElementwiseRMSNorm`: a norm across heads shards by its statistic). None where it needs none.
    `processors` adds processor classes to those the class lists (diffusers' generic `Attention` lists none: each
    model sets its own, SD3's `JointAttnProcessor2_0`, CogVideoX's `CogVideoXAttnProcessor2_0`)."""
    listed = tuple(getattr(cls, "_available_processors", ())) + tuple(processors)
    processors = tuple(dict.fromkeys(p for p in listed if rule_edits(p) is not None))
    if not processors:
        return None
    rewrite = swap_rewrite(f"{cls.__name__}: heads by head_dim", cls, processors=Processors(processors),
                           children=dict.fromkeys(QK_NORMS, elementwise_norm))
    # processors and norm classes swapped, no weight sliced: a checkpoint is the same in both layouts
    return replace(rewrite, in_checkpoints=False)


def derived_all_reduces(family: Family, config: dict) -> int:
    """All-reduces one forward makes under the derived plan: one per rowwise Linear and per norm across heads (each
    runs once per forward in these DiTs), read off the model built from `config` on meta."""
    model = unfuse(model_on_meta(family, config))
    return sum(all_reduces(style) for _, _, plan in planned_for(model) for style in plan.values())


def all_reduces(style) -> int:
    """The all-reduces one call of a module under `style` makes: a rowwise Linear that replicates its output, a
    module output resolved from partial sums, a norm across heads (its statistic)."""
    if isinstance(style, RowwiseParallel):
        return int(all(p.is_replicate() for p in style.output_layouts))
    if isinstance(style, PrepareModuleOutput):
        return int(any(p.is_partial() for p in style.output_layouts if p is not None)
                   and all(p.is_replicate() for p in style.desired_output_layouts if p is not None))
    return int(isinstance(style, AcrossHeadsNorm))


def derived_family(name: str, model_class: type[nn.Module], *, attention: tuple[type[nn.Module], ...] = (),
                   processors: tuple[type, ...] = (), **fields) -> Family:
    """A `Family` whose rewrites and plans are derived: `attention` lists the model's attention classes (their
    rewrites from `attention_rewrite`, with the stock `processors` the model sets where a class lists none); `fields` are the data (variants, sources, test configs, example inputs,
    replicated Linears). Its all-reduce count is read off the derived plan."""
    rewrites = tuple(r for r in (attention_rewrite(cls, processors) for cls in attention) if r is not None)
    holder: list[Family] = []
    family = Family(name=name, model_class=model_class, rewrites=rewrites,
                    count_all_reduces=lambda config: derived_all_reduces(holder[0], config), **fields)
    holder.append(family)
    return family
