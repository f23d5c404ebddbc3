"""Tensor-parallel plans: which modules a plan covers in a model, the plan each block gets, and plans as literals.

A block's plan is assembled here, once: `planned_for` finds the planned modules (the registered per-class plans, or
a user's literal `plan=`, kept by `filter_fn`), `block_plans` composes them by prefix into one plan per transformer
block, and `effective_plan` shows the result as `tensor_parallel` applies it. `style_source` and `plan_source` write
stock styles and plans back as the Python a user would type.
"""

from __future__ import annotations

import copy
import json
from fnmatch import fnmatchcase
from typing import Callable

import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from surgery.core.errors import SurgeryError
from surgery.core.registry import tp_plan_for
from surgery.core.walk import find_modules, outermost
from surgery.parallel.transformers_plans import stock_plan

Planned = list[tuple[str, nn.Module, dict]]
FilterFn = Callable[[nn.Module, str], bool]


def per_head_norm(head_dim: int = 2) -> SequenceParallel:
    """The style for a norm applied to each rank's own heads (QK-norm on `[batch, seq, heads, head_dim]`).

    Its weight becomes a replicated DTensor and its input is declared sharded on the heads dim, so gradients of the
    weight are summed over ranks; no collective runs in forward.
    """
    return SequenceParallel(sequence_dim=head_dim, use_local_output=True)


def planned_modules(model: nn.Module) -> Planned:
    """`(path, module, plan)` for every module with a registered plan (outermost only; keys that exist only), then
    those that transformers' own plan names (`surgery.parallel.transformers_plans`), outside the registered ones."""

    def match(module: nn.Module) -> dict | None:
        plan, _ = tp_plan_for(module)
        if plan is None:
            return None
        return {key: style for key, style in plan.items() if key == "" or _has_submodule(module, key)}

    registered_plans = outermost(model, match)
    covered = [path for path, _, _ in registered_plans]

    def inside(path: str) -> bool:
        return any(p == "" or path == p or path.startswith(p + ".") for p in covered)

    # Modules no registered plan covers, where the model carries transformers' own plan (a text encoder).
    return registered_plans + stock_plan(model, skip=inside)


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def block_path(model: nn.Module, path: str) -> tuple[str, bool]:
    """The enclosing transformer block: the path up to the first ModuleList element (True), else `path` (False)."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if isinstance(model.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[: i + 1]), True
    return path, False


def wildcard_path(model: nn.Module, path: str) -> str:
    """`path` with its block's index in the block list as `*` (`transformer_blocks.3.attn` ->
    `transformer_blocks.*.attn`): the key that names the same module in every block of the list."""
    block, in_list = block_path(model, path)
    if not in_list:
        return path
    return _join(block.rpartition(".")[0], "*") + path[len(block):]


def literal_planned(model: nn.Module, plan: dict) -> Planned:
    """A user's literal plan (`{module path: stock style}`, `*` standing for one name as in `parallelize_module`)
    in `planned_modules`' form: each matched module under its block (the element of the first ModuleList on its path)
    or, outside every block, under its parent; blocks in model order, a block's entries in the plan's order.

    A key that matches no module, a module that two keys match, and a value that is not a `ParallelStyle` are
    refused with a `SurgeryError` naming the key: each of them would shard something else than the user wrote.
    """
    if not isinstance(plan, dict):
        raise SurgeryError(
            f"surgery.tensor_parallel: plan= is a dict {{module path: ParallelStyle}}, got {type(plan).__name__}."
        )
    if not plan:
        raise SurgeryError("surgery.tensor_parallel: plan= is empty, so nothing would be sharded. Pass plan=None for "
                           "the registered plans.")
    for key, style in plan.items():
        if not isinstance(key, str):
            raise SurgeryError(f"surgery.tensor_parallel: plan key {key!r} is a {type(key).__name__}, not a module "
                               "path.")
        if not isinstance(style, ParallelStyle):
            raise SurgeryError(
                f"surgery.tensor_parallel: plan['{key}'] is a {type(style).__name__}, not a ParallelStyle; write a "
                "stock style such as ColwiseParallel() (torch.distributed.tensor.parallel)."
            )
    patterns = [(key, key.split(".") if key else []) for key in plan]
    order = {key: i for i, key in enumerate(plan)}
    owners: dict[str, list[tuple[str, str]]] = {}  # owner -> [(key, module path)], owners in model order
    for path, _ in model.named_modules():
        names = path.split(".") if path else []
        keys = [key for key, atoms in patterns
                if len(atoms) == len(names) and all(fnmatchcase(n, a) for n, a in zip(names, atoms))]
        if not keys:
            continue
        if len(keys) > 1:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' matches plan keys '{keys[0]}' and '{keys[1]}'; a module takes one "
                "style. Narrow one of the keys."
            )
        block, in_list = block_path(model, path)
        owners.setdefault(block if in_list else path.rpartition(".")[0], []).append((keys[0], path))
    matched = {key for entries in owners.values() for key, _ in entries}
    for key in plan:
        if key not in matched:
            raise SurgeryError(f"surgery.tensor_parallel: plan key '{key}' matches no module of "
                               f"{type(model).__name__}.{_hint(model, key)}")
    # within a block, in the plan's order (as parallelize_module applies a dict)
    return [(owner, model.get_submodule(owner),
             {path[len(owner):].lstrip("."): plan[key] for key, path in sorted(entries, key=lambda e: order[e[0]])})
            for owner, entries in owners.items()]


def _hint(model: nn.Module, key: str) -> str:
    """A key that would match, where `key` names modules relative to a block (`attn.to_q`)."""
    tail = key.split(".")
    for path, _ in model.named_modules():
        names = path.split(".")
        if len(names) > len(tail) and all(fnmatchcase(n, a) for n, a in zip(names[-len(tail):], tail)):
            return (f" Keys are paths from the model's root, '*' standing for one name: did you mean "
                    f"'{_join(wildcard_path(model, '.'.join(names[:-len(tail)])), key)}'?")
    return " Keys are paths from the model's root, '*' standing for one name (transformer_blocks.*.attn.to_q)."


def kept(planned: Planned, filter_fn: FilterFn) -> Planned:
    """The entries of `planned` whose module `filter_fn(module, fqn)` keeps (torchao's `quantize_` signature);
    modules left with no entry drop out, and are not checked: they stay whole on every rank."""
    out = []
    for path, module, plan in planned:
        entries = {key: style for key, style in plan.items() if filter_fn(module.get_submodule(key), _join(path, key))}
        if entries:
            out.append((path, module, entries))
    if planned and not out:
        count = sum(len(plan) for _, _, plan in planned)
        raise SurgeryError(f"surgery.tensor_parallel: filter_fn kept none of the {count} planned modules, so nothing "
                           "would be sharded.")
    return out


def planned_for(model: nn.Module, plan: dict | None = None, filter_fn: FilterFn | None = None) -> Planned:
    """The planned modules `tensor_parallel(model, mesh, plan, filter_fn)` shards: the registered plans (or `plan`),
    kept by `filter_fn`."""
    planned = planned_modules(model) if plan is None else literal_planned(model, plan)
    return planned if filter_fn is None else kept(planned, filter_fn)


def enclosing(model: nn.Module, planned: Planned) -> Planned:
    """`(path, module, {})` for the modules between each planned module and its entries (`attn` for a block's
    `attn.to_q`), so that their checks (heads, registered checks) run on a literal plan as on the registered ones."""
    paths: dict[str, None] = {}
    for owner, _, plan in planned:
        for key in plan:
            names = key.split(".") if key else []
            for i in range(1, len(names)):
                paths[_join(owner, *names[:i])] = None
    return [(path, model.get_submodule(path), {}) for path in paths]


def block_plans(model: nn.Module, planned: Planned) -> dict[str, dict[str, ParallelStyle]]:
    """Block path -> the plan `tensor_parallel` applies to it, keys relative to the block (`""`: the block's own
    style, applied after the others), each style a fresh copy. A planned module's entries go to its block (the
    element of the first ModuleList on its path) by prefix: a single-stream block's plan holds its attention's."""
    blocks: dict[str, dict[str, ParallelStyle]] = {}
    own: dict[str, ParallelStyle] = {}
    for path, _, plan in planned:
        block, _ = block_path(model, path)
        relative = path[len(block):].lstrip(".")
        entries = blocks.setdefault(block, {})
        for key, style in plan.items():
            full = _join(relative, key)
            if full:
                entries[full] = copy.copy(style)
            else:
                own.setdefault(block, copy.copy(style))
    for block, style in own.items():
        blocks[block][""] = style
    return blocks


def check_unfused(model: nn.Module, verb: str = "tensor_parallel") -> None:
    """A plan shards unfused modules only: a fused one would be cut across its concatenated projections."""
    fused = find_modules(model, fused=True)
    if fused:
        path, module, _ = fused[0]
        raise SurgeryError(
            f"surgery.{verb}: '{path}' is still a fused {type(module).__name__} ({len(fused)} fused "
            "module(s) in all); column sharding would cut across its concatenated projections. Call "
            "surgery.unfuse(model) first."
        )


def effective_plan(model: nn.Module, path: str | None = None, *, plan: dict | None = None,
                   filter_fn: FilterFn | None = None) -> dict[str, ParallelStyle]:
    """The literal plan `tensor_parallel(model, mesh, plan, filter_fn)` applies: `{module path: stock style}`, every
    registered plan composed by prefix, in the order it is applied (fresh copies, yours to edit).

    Keys are relative to the model, or with `path` (a block, `"transformer_blocks.0"`, or any module) to it, `""`
    being the module itself. Passed back as `plan=` it shards the model alike. A fused model is refused, as
    `tensor_parallel` refuses it.
    """
    check_unfused(model, "effective_plan")
    flat = {}
    for block, entries in block_plans(model, planned_for(model, plan, filter_fn)).items():
        for key, style in entries.items():
            flat[_join(block, key)] = style
    if path is None:
        return flat
    if not _has_submodule(model, path):
        raise SurgeryError(f"surgery.effective_plan: {type(model).__name__} has no module '{path}'.")
    return {key[len(path):].lstrip("."): style for key, style in flat.items()
            if not path or key == path or key.startswith(path + ".")}


# --- plans as literals -----------------------------------------------------------------------------------------------

_REQUIRED = object()

# Each stock style's init arguments and their defaults (`_REQUIRED`: none), as torch 2.x defines them.
_STYLE_DEFAULTS = {
    ColwiseParallel: {"input_layouts": Replicate(), "output_layouts": Shard(-1), "use_local_output": True},
    RowwiseParallel: {"input_layouts": Shard(-1), "output_layouts": Replicate(), "use_local_output": True},
    SequenceParallel: {"sequence_dim": 1, "use_local_output": False},
    PrepareModuleInput: {"input_layouts": None, "desired_input_layouts": None, "input_kwarg_layouts": None,
                         "desired_input_kwarg_layouts": None, "use_local_output": False},
    PrepareModuleOutput: {"output_layouts": _REQUIRED, "desired_output_layouts": _REQUIRED, "use_local_output": True},
    PrepareModuleInputOutput: {"input_layouts": None, "desired_input_layouts": None, "input_kwarg_layouts": None,
                               "desired_input_kwarg_layouts": None, "use_local_input": False,
                               "output_layouts": _REQUIRED, "desired_output_layouts": _REQUIRED,
                               "use_local_output": True},
}


def style_state(style: ParallelStyle) -> dict:
    """What a style's `__init__` stored, the styles it composes (`PrepareModuleInputOutput`) by their own state."""
    return {k: style_state(v) if isinstance(v, ParallelStyle) else v for k, v in vars(style).items()}


def _argument(style: ParallelStyle, name: str):
    """An init argument of a stock style, read back from what its `__init__` stored."""
    if name == "sequence_dim":
        return style.sequence_sharding[0].dim
    if isinstance(style, PrepareModuleInputOutput):  # its arguments live on the two styles it composes
        if name == "use_local_input":
            return style.prepare_module_input.use_local_output
        part = style.prepare_module_output if name in _STYLE_DEFAULTS[PrepareModuleOutput] else style.prepare_module_input
        return _argument(part, name)
    value = getattr(style, name)
    if isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], Placement):
        return value[0]
    return None if value == {} else value


def _source(value) -> str:
    if isinstance(value, Placement):
        if type(value) is Shard:
            return f"Shard({value.dim})"
        if type(value) is Replicate:
            return "Replicate()"
        if type(value) is Partial:
            return "Partial()" if value.reduce_op == "sum" else f"Partial({value.reduce_op!r})"
        raise SurgeryError(f"surgery: placement {value!r} has no literal form here (Shard, Replicate, Partial).")
    if isinstance(value, tuple):
        return f"({', '.join(_source(v) for v in value)}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_source(v)}" for k, v in value.items()) + "}"
    return repr(value)


def style_source(style: ParallelStyle) -> str:
    """The Python that builds `style`, as a user writes it (`RowwiseParallel(output_layouts=Partial(),
    use_local_output=False)`: default arguments left out). Checked by rebuilding: a style that this would not give
    back exactly (a subclass, a custom style) raises `SurgeryError` instead of printing something else."""
    cls = type(style)
    defaults = _STYLE_DEFAULTS.get(cls)
    if defaults is None:
        raise SurgeryError(f"surgery: {cls.__qualname__} is not a stock torch style; it has no literal form here.")
    arguments = {name: _argument(style, name) for name in defaults}
    arguments = {name: value for name, value in arguments.items()
                 if defaults[name] is _REQUIRED or type(value) is not type(defaults[name]) or value != defaults[name]}
    if style_state(cls(**arguments)) != style_state(style):
        raise SurgeryError(f"surgery: this {cls.__name__} has no literal form here ({vars(style)}).")
    return f"{cls.__name__}({', '.join(f'{name}={_source(value)}' for name, value in arguments.items())})"


def plan_source(plan: dict[str, ParallelStyle], comments: dict[str, str] | None = None) -> str:
    """`plan` as a Python dict literal of stock styles, one entry a line; `comments[key]` goes on its own line
    before `key`'s entry. It evaluates (`from torch.distributed.tensor import *` and `from
    torch.distributed.tensor.parallel import *`) to an equal plan."""
    lines = ["{"]
    for key, style in plan.items():
        if comments and key in comments:
            lines += [f"    # {line}" for line in comments[key].splitlines()]
        lines.append(f"    {json.dumps(key)}: {style_source(style)},")
    return "\n".join([*lines, "}"])
