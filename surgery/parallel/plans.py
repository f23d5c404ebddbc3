"""Tensor-parallel plans: which modules a plan covers in a model, the plan each block gets, and plans as literals.

A block's plan is assembled here, once: `planned_for` finds the planned modules (the registered per-class plans, or
a user's literal `plan=`, kept by `filter_fn`), `check_planned` checks them, `block_plans` composes them by prefix
into one plan per transformer block, and `effective_plan` shows the result as `tensor_parallel` applies it. Nothing
here changes a model. `style_source` and `plan_source` write
stock styles and plans back as the Python a user would type.
"""

from __future__ import annotations

import copy
import functools
import hashlib
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

from surgery.core.checks import check_hooks, check_linear, check_model, check_parameter, mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.core.heads_padding import refusal_hint
from surgery.core.registry import refused_reason, replicated_for, tp_plan_for, tp_plans
from surgery.core.walk import find_modules, outermost
from surgery.parallel.derive import (AcrossHeadsNorm, ColwiseIntoHeads, DepthwiseChannels, HeadsInputs, PerHeadParameters,
                                     Refused, RowwiseIntoHeads, check_derived_heads, derived, is_attention,
                                     query_projection)
from surgery.parallel import quantized as quant
from surgery.parallel.transformers_plans import check_heads as transformers_check_heads
from surgery.parallel.styles import ImplicitReplication, ShardParameters
from surgery.parallel.transformers_plans import stock_plan

Planned = list[tuple[str, nn.Module, dict]]
FilterFn = Callable[[nn.Module, str], bool]


def planned_modules(model: nn.Module) -> Planned:
    """`(path, module, plan)` for every module with a registered plan (outermost only; keys that exist only), then
    the attention modules of the transformer blocks that no registered plan covers, with their derived plans
    (`surgery.parallel.derive`), then those that transformers' own plan names
    (`surgery.parallel.transformers_plans`), outside the registered ones."""

    def match(module: nn.Module) -> dict | None:
        plan, _ = tp_plan_for(module)
        if plan is None:
            return None
        return {key: style for key, style in plan.items() if key == "" or _has_submodule(module, key)}

    registered_plans = outermost(model, match)
    covered = [path for path, _, _ in registered_plans]
    derived_plans = [(path, module, plan) for path, module, plan in derived_in_blocks(model, covered)
                     if not isinstance(plan, Refused)]
    covered += [path for path, _, _ in derived_plans]

    def inside(path: str) -> bool:
        return any(p == "" or path == p or path.startswith(p + ".") for p in covered)

    # Modules no registered plan covers, where the model carries transformers' own plan (a text encoder).
    return registered_plans + derived_plans + stock_plan(model, skip=inside)


def derived_in_blocks(model: nn.Module, covered: list[str]) -> list[tuple[str, nn.Module, dict | Refused]]:
    """`(path, module, derived plan or Refused)` for the modules of the transformer blocks that a derivation rule is
    about, outside the `covered` paths and with no registered plan that accepts them (a family's plan overrides)."""
    out: list[tuple[str, nn.Module, dict | Refused]] = []
    for block, module in transformer_blocks(model):
        for key, child in module.named_modules():
            path = _join(block, key)
            # a derived plan of the module's own key alone (its per-head parameters) leaves its children to theirs
            if any(p == "" or path == p or path.startswith(p + ".") for p in covered) or any(
                    path.startswith(p + ".") for p, _, plan in out if isinstance(plan, Refused) or set(plan) != {""}):
                continue
            if tp_plan_for(child)[0] is not None:
                continue
            plan = derived(child)
            if plan is not None and not _declared_whole(module, key, child):
                out.append((path, child, plan))
    return out


def _declared_whole(block: nn.Module, key: str, module: nn.Module) -> bool:
    """Whether a family declares a Linear of `module` (at `key` in `block`) whole on every rank: its declaration wins
    over a derivation rule (Stable Audio 3's `to_local_embed` is an MLP the rule would shard)."""
    return any(declared_reason(block, _join(key, k)) for k, m in module.named_modules() if isinstance(m, nn.Linear))


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


# --- coverage: no block left half sharded in silence -----------------------------------------------------------------

# Linears of diffusers' adaptive norms (AdaLayerNormZero, AdaLayerNormContinuous, LuminaRMSNormZero, ...) turn the
# conditioning embedding, which every rank holds whole, into the shifts, scales and gates of the full-width hidden
# states: whole on every rank by design (diffusers' own `_tp_plan` leaves them so too).
# Linears of diffusers' embedding modules (timestep, pooled-text and caption embedders) read inputs every rank holds
# whole and feed the conditioning: whole too.
ADAPTIVE_NORM = "adaptive-norm modulation of the replicated conditioning embedding"
DERIVED_REPLICATED = {
    "diffusers.models.normalization": ADAPTIVE_NORM,
    "diffusers.models.embeddings": "an embedder of inputs every rank holds whole (timestep, pooled text, caption)",
}
# The same modules written inside a model's own file (CogView4AdaLayerNormZero, HunyuanVideo15AdaNorm, MochiRMSNormZero,
# Kandinsky5Modulation, MochiLayerNormContinuous, ...): known by diffusers' naming of adaptive norms and modulations
# (`...NormContinuous`: a norm whose scale comes from the conditioning, as AdaLayerNormContinuous's).
ADAPTIVE_NORM_NAMES = ("AdaLayerNorm", "AdaNorm", "NormZero", "Modulation", "NormContinuous")
# ... or a plain Sequential(SiLU, Linear) the block names so (Z-Image's `adaLN_modulation`)
ADAPTIVE_NORM_ATTRIBUTES = ("adaln", "modulation")


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(path, block)` for the model's transformer blocks, outermost only: the modules of its `_repeated_blocks`
    classes (diffusers' regional-compile list) and the elements of the ModuleLists that are its direct children
    (both: a list may miss a variant's block class, HunyuanVideo-I2V's token-replace blocks, or blocks injected
    between the others, WanAnimate's face adapters)."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    lists = {id(child) for child in model.children() if isinstance(child, nn.ModuleList)}
    parents = dict(model.named_modules())
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(p + ".") for p, _ in found):
            continue
        if type(module).__name__ in names or id(parents[path.rpartition(".")[0]]) in lists:
            found.append((path, module))
    return found


def declared_reason(block: nn.Module, key: str) -> str | None:
    """The reason an enclosing module's class declares the Linear at `key` (relative to `block`) whole, or None."""
    names = key.split(".")
    for i in range(len(names)):
        owner = block.get_submodule(".".join(names[:i]))
        for pattern, reason in replicated_for(owner).items():
            if fnmatchcase(".".join(names[i:]), pattern):
                return reason
    return None


def replicated_reason(block: nn.Module, key: str) -> str | None:
    """Why the Linear at `key` (relative to `block`) is whole on every rank on purpose, or None: an enclosing
    module's class declares it (`surgery.core.registry.register_replicated`), or it belongs to an adaptive norm."""
    declared = declared_reason(block, key)
    if declared is not None:
        return declared
    names = key.split(".")
    for i in range(len(names)):
        owner = block.get_submodule(".".join(names[:i]))
        if i and type(owner).__module__ in DERIVED_REPLICATED:
            return DERIVED_REPLICATED[type(owner).__module__]
        if i and (any(name in type(owner).__name__ for name in ADAPTIVE_NORM_NAMES)
                  or any(name in names[i - 1].lower() for name in ADAPTIVE_NORM_ATTRIBUTES)):
            return ADAPTIVE_NORM
    return None


def unplanned_linears(model: nn.Module, planned: Planned) -> tuple[list[tuple[str, nn.Module]], int]:
    """The Linears inside transformer blocks that no plan entry covers (the entry's path, or one above it: a
    PEFT-wrapped or split leaf) and no declaration keeps whole on purpose; and how many Linears the blocks hold."""
    covered = {_join(path, key) for path, _, plan in planned for key in plan}
    left, total = [], 0
    for block_path_, block in transformer_blocks(model):
        for key, module in block.named_modules():
            if not isinstance(module, nn.Linear) or not key:
                continue
            total += 1
            path = _join(block_path_, key)
            names = path.split(".")
            if any(".".join(names[:i]) in covered for i in range(1, len(names) + 1)):
                continue
            if replicated_reason(block, key) is None:
                left.append((path, module))
    return left, total


def check_coverage(model: nn.Module, planned: Planned, verb: str = "tensor_parallel") -> None:
    """Refuse a model whose blocks the registered plans would shard only in part: every rank would keep the rest
    whole, and the model would look sharded while holding most of its weights on each rank."""
    left, total = unplanned_linears(model, planned)
    if not left:
        return
    path, module = left[0]
    owner = path.rpartition(".")[0]
    owner_cls = type(model.get_submodule(owner)).__name__ if owner else type(model).__name__
    refusals = [(p, plan.reason) for p, _, plan in derived_in_blocks(model, [p for p, _, _ in planned])
                if isinstance(plan, Refused) and path.startswith(p + ".")]
    why = f" (no plan derived for '{refusals[0][0]}': {refusals[0][1]})" if refusals else ""
    raise SurgeryError(
        f"surgery.{verb}: '{path}' ({type(module).__name__} in a {owner_cls}) has no tensor-parallel plan{why}: "
        f"{len(left)} of the {total} Linears in {type(model).__name__}'s transformer blocks would stay whole on "
        "every rank, a half-sharded model. Give its module a plan (surgery.extend.TensorParallel(plans=...) in a "
        "family registered with surgery.extend.register_family), declare it replicated on purpose with its reason "
        "(surgery.extend.register_replicated), or pass plan= / filter_fn= to shard only what you name."
    )


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
        raise SurgeryError(f"surgery plan: {type(model).__name__} has no module '{path}'.")
    return {key[len(path):].lstrip("."): style for key, style in flat.items()
            if not path or key == path or key.startswith(path + ".")}


# --- building and checking the plan a verb applies ---------------------------------------------------------------

def linear_placements(style: ParallelStyle, module: nn.Module | None = None) -> dict[str, tuple] | None:
    """How a stock linear style places a Linear's parameters (`None` for styles that place none); for an
    `nn.Embedding` (`module`), as the stock styles place its `[num_embeddings, dim]` weight: colwise shards the
    embedding dim, rowwise the vocabulary."""
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {"weight": (Shard(1 if embedding else 0),), "bias": (Shard(0),)}
    if isinstance(style, RowwiseParallel):
        return {"weight": (Shard(0 if embedding else 1),), "bias": (Replicate(),)}
    if isinstance(style, ShardParameters):
        return {name: (placement,) for name, placement in style.placements.items()}
    return None


def check_plan(model: nn.Module, planned: Planned, world: int) -> None:
    """Every check of a plan against the model and a mesh of `world` ranks, before anything changes."""
    check_unfused(model)
    reason = refused_reason(model)
    if reason is not None:
        raise SurgeryError(f"surgery.tensor_parallel: {type(model).__name__} is not sharded: {reason}.")
    if not planned:
        known = sorted(getattr(cls, "__name__", str(cls).rpartition(".")[2]) for cls in tp_plans())
        left, total = unplanned_linears(model, planned)
        first = ""
        if left:
            path = left[0][0]
            owner = type(model.get_submodule(path.rpartition(".")[0])).__name__
            why = next((f": no plan derived for '{p}': {plan.reason}" for p, _, plan in derived_in_blocks(model, [])
                        if isinstance(plan, Refused) and path.startswith(p + ".")), ", and no derivation rule matches it")
            first = f" The first of the {total} Linears in its transformer blocks is '{path}' (in a {owner}){why}."
        raise SurgeryError(
            f"surgery.tensor_parallel: '{type(model).__name__}' holds no module with a tensor-parallel plan "
            f"(known: {', '.join(known)}).{first} Give its blocks a plan: "
            "surgery.extend.TensorParallel(plans=...) in a family (surgery.extend.register_family), or plan=."
        )
    check_model(model, "tensor_parallel")
    check_hooks(model, "<model>", "tensor_parallel", torch_hooks=False)
    for path, module, plan in planned:
        registered, check = tp_plan_for(module)
        if check is None and is_attention(module) and isinstance(query_projection(module), nn.Linear):
            # query and key/value (GQA) heads split evenly, under a derived plan or a registered one without its
            # own check (QwenImage's plan for diffusers' generic `Attention` also covers Lumina2's GQA one)
            check = functools.partial(check_derived_heads, plan=plan)
        check = check or transformers_check_heads
        if check is not None:
            check(module, path, world)
        heads = getattr(module, "heads", None)
        if isinstance(heads, int) and heads % world:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' has {heads} attention heads, which a mesh of {world} cannot "
                f"split evenly. Use a mesh size that divides {heads}: {mesh_sizes_dividing(heads)}"
                f"{refusal_hint(world)}."
            )
        for key, style in plan.items():
            linear = module.get_submodule(key)
            placements = linear_placements(style, linear)
            if placements is None:
                continue
            linear_path = f"{path}.{key}" if path else key
            if isinstance(style, ShardParameters):  # a module's own parameters (3-D expert weights), each its dim
                for name, (placement,) in placements.items():
                    _check_split_parameter(getattr(linear, name), f"{linear_path}.{name}", placement.dim, world)
                continue
            check_linear(linear, linear_path, "tensor_parallel", embedding=isinstance(linear, nn.Embedding),
                         quantized=quant.quantized)
            check_hooks(linear, linear_path, "tensor_parallel", torch_hooks=False)
            dim = placements["weight"][0].dim
            if quant.quantized(linear.weight):
                quant.check_split(linear.weight, dim, world, f"{linear_path}.weight")
            size = linear.weight.shape[dim]
            if size % world:
                what = "output features" if dim == 0 else "input features"
                raise SurgeryError(
                    f"surgery.tensor_parallel: '{linear_path}' has {size} {what}, which a mesh of {world} cannot "
                    f"split evenly. Use a mesh size that divides {size}: {mesh_sizes_dividing(size)}."
                )


def _check_split_parameter(param, path: str, dim: int, world: int) -> None:
    check_parameter(param, path, "tensor_parallel")
    if param.shape[dim] % world:
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}' has {param.shape[dim]} entries along dim {dim}, which a mesh of "
            f"{world} cannot split evenly. Use a mesh size that divides {param.shape[dim]}: "
            f"{mesh_sizes_dividing(param.shape[dim])}."
        )


def check_whole_units(model: nn.Module, planned: Planned, given: str) -> None:
    """A literal plan or a filter keeps each registered (or derived) plan's module whole or drops it whole: one
    sharded Linear whose partner stays whole (q/k/v without their output projection, a split projection's parts
    without the resolution of their partial sum, heads without their norms) computes with mismatched shapes or
    wrong gradients, found only in the forward or not at all."""
    kept = {_join(path, key) for path, _, plan in planned for key in plan}
    for path, module, plan in planned_modules(model):
        entries = {_join(path, key): (key, style) for key, style in plan.items()}
        have = [name for name in entries if name in kept]
        missing = [name for name in entries if name not in kept]
        if have and missing:
            def named(names):
                return ", ".join(f"'{entries[n][0] or '<itself>'}' ({type(entries[n][1]).__name__})" for n in names[:3]) + (
                    f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise SurgeryError(
                f"surgery.tensor_parallel: {given} shards {named(have)} of '{path or '<model>'}' "
                f"({type(module).__name__}) but leaves its partner{'s' if len(missing) > 1 else ''} {named(missing)} "
                f"whole; half a sharded module computes with mismatched shapes or wrong gradients. Keep or drop all "
                f"{len(entries)} entries of '{path or '<model>'}' together."
            )


def check_planned(model: nn.Module, planned: Planned, world: int, plan: dict | None = None,
                  filter_fn: FilterFn | None = None) -> None:
    """Every check of `planned` (what `planned_for(model, plan, filter_fn)` returned) for a mesh of `world` ranks,
    before anything changes; changes nothing itself."""
    if plan is not None or filter_fn is not None:
        check_whole_units(model, planned, "plan=" if plan is not None else "filter_fn")
    # a literal plan names leaves; the modules above them (attention: heads) are checked as the registered plans'
    # owners are
    check_plan(model, planned if plan is None else [*enclosing(model, planned), *planned], world)
    if plan is None and filter_fn is None:  # a literal plan or a filter names what stays whole; the registry must
        check_coverage(model, planned)


def checked_plan(model: nn.Module, plan: dict | None, filter_fn: FilterFn | None, world: int) -> Planned:
    """The planned modules of `tensor_parallel(model, mesh, plan, filter_fn)` (and of `load_tensor_parallel`), built
    and checked for a mesh of `world` ranks: `planned_for`, then `check_planned`. Changes nothing: a pre-quantized
    model's Linears are adopted by the verbs first (`surgery.parallel.quantized.adopt`)."""
    planned = planned_for(model, plan, filter_fn)
    check_planned(model, planned, world, plan, filter_fn)
    return planned


def plan_digest(planned: Planned) -> str:
    """A short digest of what `planned` shards and how, for the ranks to compare before sharding."""
    entries = [(path, key, f"{type(style).__qualname__} {sorted(vars(style).items())!r}")
               for path, _, plan in planned for key, style in plan.items()]
    digest = hashlib.blake2b(repr(entries).encode(), digest_size=8).hexdigest()
    return f"{len(entries)} planned modules, digest {digest}"


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
    # this library's two (surgery.parallel.styles): a module's own parameters, a stock forward run on DTensors
    ShardParameters: {"placements": _REQUIRED},
    ImplicitReplication: {"sum_output": False},
    # the ones a family's plan may name from surgery.parallel.derive (SANA-WM's); "*names": positional arguments
    AcrossHeadsNorm: {"use_local_output": True, "statistics": 1},
    PerHeadParameters: {"*names": _REQUIRED},
    DepthwiseChannels: {},
    ColwiseIntoHeads: {},
    RowwiseIntoHeads: {},
    HeadsInputs: {"local": (), "whole": ()},
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
    positional = tuple(getattr(style, name[1:]) for name in defaults if name.startswith("*"))
    positional = positional[0] if positional else ()
    arguments = {name: _argument(style, name) for name in defaults if not name.startswith("*")}
    arguments = {name: value for name, value in arguments.items()
                 if defaults[name] is _REQUIRED or type(value) is not type(defaults[name]) or value != defaults[name]}
    if style_state(cls(*positional, **arguments)) != style_state(style):
        raise SurgeryError(f"surgery: this {cls.__name__} has no literal form here ({vars(style)}).")
    written = [_source(value) for value in positional] + [f"{name}={_source(value)}" for name, value in arguments.items()]
    return f"{cls.__name__}({', '.join(written)})"


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
