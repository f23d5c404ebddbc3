"""`unfuse` and `fuse`: walk a model, swap every registered fused module for its unfused form, or back.

Both verbs check everything first and only then swap modules, one at a time, so peak memory grows by one module's
column copies (with their grads and optimizer state) at most. Gradients and the state of the optimizers passed travel
with the weights. Should a swap still fail (out of memory, KeyboardInterrupt), the very same module and Parameter
objects are put back, with their values, before the error propagates.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from surgery.core import heads_padding
from surgery.core.errors import SurgeryError
from surgery.core.prequantized import GGUFWeight, adopt_prequantized, check_columns, restore_adopted, sliceable
from surgery.core.checks import (
    check_hooks,
    check_linear,
    check_model,
    check_parameter,
    check_replaced_parameter,
    check_wrappers,
    wrapper_error,
    wrapper_kind,
)
from surgery.core.split_projection import pack_all, track_leaves, unpack_all
from surgery.core.registry import Rewrite
from surgery.core.slicing import Slice, concat, group_by_fused, take
from surgery.core.walk import find_modules


@dataclass(frozen=True)
class RewriteRecord:
    """One module swapped by `unfuse` or `fuse`."""

    path: str
    before: str
    after: str
    slices: tuple[Slice, ...]  # parameter names relative to the model passed in
    bytes_copied: int


_REPORT_ATTR = "_surgery_report"


def last_report(model: nn.Module) -> list[RewriteRecord]:
    """What the last `unfuse` or `fuse` on `model` rewrote (empty if nothing)."""
    return list(getattr(model, _REPORT_ATTR, []))


Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None]


def unfuse(model: nn.Module, optimizer: Optimizers = None) -> nn.Module:
    """Swap every fused module in `model` for its equivalent unfused module, in place.

    Row slices (q, k, v, gate, up) are views of the fused weights' storage, which each `SplitRows` multiplies by
    once (`surgery.core.split_projection`); column splits are copies. Gradients are sliced like the weights. `optimizer` (one or several): their parameter groups and per-parameter state
    (Adam's `exp_avg`, `exp_avg_sq` sliced like the weight, `step` copied) move to the unfused parameters, so the
    next step is the step the fused model would have taken. An optimizer that holds a fused parameter but is not
    passed, tensor hooks, ties and DDP/FSDP wrappers are refused. Idempotent; a model with nothing to rewrite is
    returned unchanged. Returns `model` (a new module only when `model` itself is a fused module).
    `surgery.core.rewrite.last_report(model)` lists what was rewritten.
    """
    with _collection_paused():
        adopted = adopt_prequantized(model)  # diffusers' GGUF / fp8r Linears as nn.Linears over the same values
        try:
            return _rewrite(model, unfusing=True, optimizers=_optimizers(optimizer))
        except BaseException:
            restore_adopted(adopted)
            raise


def fuse(model: nn.Module, optimizer: Optimizers = None) -> nn.Module:
    """The exact inverse of `unfuse`: stock module classes back in place, weights bitwise as the unfused ones hold them.

    Rows that are still adjacent views of one storage are joined without a copy; gradients and the state of the
    optimizer(s) passed are joined the same way. A never-unfused model is unchanged.
    """
    padded = [(block, list(paddings)) for _, block, paddings in heads_padding.padded_blocks(model)]
    heads_padding.unpad(model)  # zero heads (tensor_parallel(..., pad_heads=True)) go first: the stock model has none
    with _collection_paused():
        try:
            return _rewrite(model, unfusing=False, optimizers=_optimizers(optimizer))
        except BaseException:
            pack_all(model)  # a refused or rolled-back fuse leaves the model as it was, packed leaves too
            for block, paddings in padded:
                heads_padding.pad(block, paddings)
            raise


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """The garbage collector off while a rewrite builds its many small objects: on a model of published size its
    full collections, triggered by those allocations, took most of `unfuse`'s time (FLUX.2-dev: ~0.7 s of ~1 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _optimizers(optimizer: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


@dataclass
class _Done:
    """One swap in progress or done: the very objects to put back, and how to refill what was released."""

    old: nn.Module
    new: nn.Module
    moves: list["_Move"]
    released: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = field(default_factory=list)


def _rewrite(model: nn.Module, unfusing: bool, optimizers: tuple[torch.optim.Optimizer, ...]) -> nn.Module:
    verb = "unfuse" if unfusing else "fuse"
    found = find_modules(model, fused=unfusing)
    if not found:
        return model
    check_model(model, verb)
    check_wrappers(model, verb)
    if not unfusing:  # the leaves' packed views go with them (and would count as holders of their parameters)
        unpack_all(model)
    slots_of = _names_by_parameter(model)
    replaced: list[tuple[str, nn.Parameter]] = []
    for path, module, rewrite in found:
        replaced += _check(module, path, rewrite, unfusing, verb, slots_of, optimizers)
    _check_holders(model, replaced, optimizers, verb)
    del replaced
    slots = _parent_slots(model, {id(module) for _, module, _ in found})

    # Rollback puts back the very same module and Parameter objects, so every old module is kept until the whole
    # rewrite succeeds. That costs nothing for row slices (the new parameters are views of the old storage); the old
    # tensors that were copied (column splits: weight, grad, optimizer state) are released right after their module
    # is swapped and rebuilt from the new ones on rollback. Peak memory thus stays one module's column copies (with
    # their grads and optimizer state) above the model, as when old modules were dropped one by one.
    records: list[RewriteRecord] = []
    root = model
    done: list[_Done] = []
    try:
        for path, module, rewrite in found:
            new, copied, moves = _convert(module, rewrite, unfusing, optimizers)
            slices = tuple(s.prefixed(path) for s in rewrite.slices(module))
            before, after = _labels(module, new)
            records.append(RewriteRecord(path, before, after, slices, copied))
            done.append(_Done(module, new, moves))
            root = _swap(root, slots, module, new)
            _release(moves, done[-1].released)
        commits = [_optimizer_commit(opt, [m for d in done for m in d.moves]) for opt in optimizers]
    except BaseException:
        for entry in reversed(done):
            for tensor, rebuild in reversed(entry.released):
                tensor.data = rebuild()
            root = _swap(root, slots, entry.new, entry.old, back=True)
        raise
    while commits:  # plain list and dict assignments: nothing left that can fail halfway
        commits.pop()()
    # An old tensor that someone outside still holds (a user's reference to an old module or weight) gets its values
    # back; that costs what the old tensor cost before. The others die with the old modules here: no name in this
    # frame may still hold an old module, a move or a closure over them.
    released = [(weakref.ref(tensor), rebuild) for entry in done for tensor, rebuild in entry.released]
    del done, found, module, moves, new
    _refill(released)
    object.__setattr__(root, _REPORT_ATTR, records)
    if unfusing:
        pack_all(root)
    track_leaves(root)
    return root


def _labels(old: nn.Module, new: nn.Module) -> tuple[str, str]:
    """The classes before and after a swap; where the class stays (only leaves or processors are swapped), the class
    with the swapped children's classes: `Flux2FeedForward[linear_in: Linear]` -> `...[linear_in: SplitRows]`."""
    if type(old) is not type(new):
        return type(old).__name__, type(new).__name__
    changed = [name for name, child in old._modules.items() if type(new._modules.get(name)) is not type(child)]
    if not changed and type(getattr(old, "processor", None)) is not type(getattr(new, "processor", None)):
        changed = ["processor"]
    if not changed:
        changed = [name for name, child in old._modules.items() if new._modules.get(name) is not child]

    def label(m: nn.Module) -> str:
        parts = ", ".join(f"{n}: {type(getattr(m, n, None)).__name__}" for n in changed)
        return f"{type(m).__name__}[{parts}]"

    return label(old), label(new)


def _refill(released: list) -> None:
    while released:
        ref, rebuild = released.pop()
        tensor = ref()
        if tensor is not None:
            tensor.data = rebuild()


def _names_by_parameter(model: nn.Module) -> dict[int, list[str]]:
    """Every name under which each Parameter object sits in `model` (several for tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _check_holders(
    model: nn.Module, replaced: list[tuple[str, nn.Parameter]], optimizers: tuple, verb: str
) -> None:
    """Refuse when an optimizer that was not passed, a DDP/FSDP wrapper around `model`, or a module outside `model`
    (a tie to an outside Linear) holds a parameter that is about to be replaced.

    Nothing registers optimizers or wrappers anywhere, so they are found through Python's garbage collector, which
    knows every live container object. The scan (~0.1-0.2 s in a process with ~400k objects) only runs when some
    replaced parameter is referenced from outside its module (its reference count says so): a model nobody trains
    costs nothing. Optimizers that do not subclass torch.optim.Optimizer are not found.
    """
    # A parameter held only by its module's `_parameters` dict has as many references here as a probe held only by
    # one dict (plus, for both, a tuple in `checked`, the loop variable and getrefcount's argument).
    holder = {"probe": nn.Parameter(torch.empty(0))}
    checked = [*replaced, ("", holder["probe"])]
    alone = next(sys.getrefcount(p) for _, p in checked[-1:])
    suspects = {id(p): name for name, p in checked[:-1] if sys.getrefcount(p) > alone}
    if not suspects:
        return

    passed = {id(opt) for opt in optimizers}
    inside = {id(m) for m in model.modules()}
    wanted = (torch.optim.Optimizer, nn.Module)
    kinds: dict[type, bool] = {}
    for obj in gc.get_objects():
        kind = type(obj)
        hit = kinds.get(kind)
        if hit is None:
            hit = kinds[kind] = issubclass(kind, wanted)
        if not hit:
            continue
        if isinstance(obj, torch.optim.Optimizer):
            if id(obj) in passed:
                continue
            for group in obj.param_groups:
                for p in group["params"]:
                    if id(p) in suspects:
                        raise SurgeryError(
                            f"surgery.{verb}: an optimizer ({type(obj).__name__}) that was not passed holds "
                            f"'{suspects[id(p)]}', which surgery.{verb} replaces; it would go on updating the old "
                            f"parameter. Pass it, `surgery.{verb}(model, optimizer=opt)`, so that its parameter groups "
                            f"and state move over, or create the optimizer after surgery.{verb}."
                        )
        elif isinstance(obj, (DistributedDataParallel, FullyShardedDataParallel)):
            if any(m is model for m in obj.modules()):
                raise wrapper_error(type(obj).__name__, wrapper_kind(obj) or type(obj).__name__, verb)
        elif id(obj) not in inside and not _traced(obj):
            tied = next(((n, p) for n, p in obj._parameters.items() if p is not None and id(p) in suspects), None)
            if tied is not None:
                tied, param = tied
                raise SurgeryError(
                    f"surgery.{verb}: '{suspects[id(param)]}' is tied to the parameter '{tied}' of a "
                    f"{type(obj).__name__} outside the model (the same Parameter object); surgery.{verb} would replace "
                    f"it in the model only and untie them. Untie them first (give the outside {type(obj).__name__} its "
                    f"own copy: `m.{tied} = nn.Parameter(m.{tied}.detach().clone())`), or tie them again afterwards."
                )


def _traced(module: nn.Module) -> bool:
    """A tracer's module (fx `GraphModule`s, the plain `nn.Module` roots that `make_fx` keeps constants on): it holds
    the model's parameters as a graph's inputs, not as a tie that would matter after the rewrite."""
    return type(module) is nn.Module or isinstance(module, torch.fx.GraphModule)


def _param(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _check(
    module: nn.Module,
    path: str,
    rewrite: Rewrite,
    unfusing: bool,
    verb: str,
    names: dict[int, list[str]],
    optimizers: tuple = (),
) -> list[tuple[str, nn.Parameter]]:
    """Everything `_convert` relies on, checked before any module of the model is swapped; returns the parameters
    that the swap replaces, by name."""
    check_hooks(module, path, verb)
    rewrite.check(module, path, verb)
    slices = rewrite.slices(module)
    _check_sources(module, path, rewrite, slices, unfusing, verb)
    for fused_name, group in group_by_fused(slices):
        if unfusing:
            _check_fused_shape(module, path, fused_name, group, verb)
        else:
            _check_parts(module, path, fused_name, group, verb, optimizers)
    return _replaced_parameters(module, path, rewrite, unfusing, verb, names)


def _check_sources(module: nn.Module, path: str, rewrite: Rewrite, slices: list[Slice], unfusing: bool,
                   verb: str) -> None:
    """Every parameter the rewrite reads exists, on a plain Linear without hooks."""
    for name in sorted({s.fused if unfusing else s.unfused for s in slices}):
        owner = name.rpartition(".")[0]
        try:
            linear = module.get_submodule(owner)
            _param(module, name)
        except AttributeError:
            raise SurgeryError(
                f"surgery.{verb}: '{path}' ({type(module).__name__}) has no parameter '{name}', which its "
                f"{rewrite.name} rewrite reads. Was the module edited after it was built?"
            ) from None
        linear_path = _join(path, owner)
        if owner:
            check_linear(linear, linear_path, verb, quantized=sliceable)
        else:  # a parameter of the module itself (a MoE's 3-D expert weights), its hooks checked with the module's
            check_parameter(_param(module, name), _join(path, name), verb)
        check_hooks(linear, linear_path, verb)


def _check_fused_shape(module: nn.Module, path: str, fused_name: str, group: list[Slice], verb: str) -> None:
    """The fused weight is as long as its slices say, along their dim."""
    dim = group[0].dim
    tensor = _param(module, fused_name)
    expected = group[-1].stop
    if tensor.dim() <= dim or tensor.shape[dim] != expected:
        raise SurgeryError(
            f"surgery.{verb}: '{path}.{fused_name}' has shape {tuple(tensor.shape)}, but "
            f"{type(module).__name__}'s dimensions give {expected} along dim {dim}. Its attributes "
            "(heads, head_dim, mlp_hidden_dim) no longer describe its weights."
        )
    if isinstance(tensor, GGUFWeight) and dim == 1:  # a column cut of GGUF bytes must keep whole blocks
        for s in group:
            check_columns(tensor, s.start, s.stop, f"surgery.{verb}: '{_join(path, fused_name)}' ({s.unfused})")


def _check_parts(module: nn.Module, path: str, fused_name: str, group: list[Slice], verb: str,
                 optimizers: tuple) -> None:
    """The unfused parts of one fused weight have their slices' sizes, one dtype, device and requires_grad, and
    training state that can be joined."""
    dim = group[0].dim
    parts = [_param(module, s.unfused) for s in group]
    for s, part in zip(group, parts):
        if part.dim() <= dim or part.shape[dim] != s.size:
            raise SurgeryError(
                f"surgery.{verb}: '{path}.{s.unfused}' has shape {tuple(part.shape)}, but "
                f"{type(module).__name__}'s dimensions give {s.size} along dim {dim}."
            )
    for attr in ("dtype", "device", "requires_grad"):
        values = {getattr(p, attr) for p in parts}
        if len(values) > 1:
            listed = ", ".join(f"{s.unfused}={getattr(p, attr)}" for s, p in zip(group, parts))
            raise SurgeryError(
                f"surgery.{verb}: the parts of '{path}.{fused_name}' differ in {attr} ({listed}), which one fused "
                f"parameter cannot hold. Give them the same {attr} first."
            )
    _check_parts_state([_join(path, s.unfused) for s in group], parts, _join(path, fused_name), optimizers, verb)


def _replaced_parameters(module: nn.Module, path: str, rewrite: Rewrite, unfusing: bool, verb: str,
                         names: dict[int, list[str]]) -> list[tuple[str, nn.Parameter]]:
    """The parameters the swap drops, by name. Every submodule and parameter of `module` that its counterpart does
    not adopt must carry nothing that would be lost with it (hooks of any kind, ties, inference tensors)."""
    counterpart = (rewrite.build_unfused if unfusing else rewrite.build_fused)(module)
    kept_modules = {id(m) for m in counterpart.modules()}
    kept_params = {id(p) for p in counterpart.parameters()}
    del counterpart
    replaced = []
    for sub_name, sub in module.named_modules():
        if id(sub) in kept_modules:
            continue
        sub_path = _join(path, sub_name)
        check_hooks(sub, sub_path, verb)
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in kept_params:
                continue
            full = _join(sub_path, name)
            check_replaced_parameter(param, full, verb, [n for n in names.get(id(param), []) if n != full])
            replaced.append((full, param))
    return replaced


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _check_parts_state(names: list[str], parts: list[torch.Tensor], fused: str, optimizers: tuple, verb: str) -> None:
    """The parts of one fused parameter must hold training state that one parameter can hold."""
    has_grad = [p.grad is not None for p in parts]
    if any(has_grad) and not all(has_grad):
        with_grad, without = names[has_grad.index(True)], names[has_grad.index(False)]
        raise SurgeryError(
            f"surgery.{verb}: '{with_grad}' has a .grad and '{without}' has none, but they become one parameter "
            f"'{fused}' with one gradient. Zero or drop their gradients alike first (optimizer.zero_grad())."
        )
    for opt in optimizers:
        states = [opt.state.get(p) or {} for p in parts]
        groups = [next((i for i, g in enumerate(opt.param_groups) if any(q is p for q in g["params"])), None)
                  for p in parts]
        what = type(opt).__name__
        if len(set(groups)) > 1:
            raise SurgeryError(
                f"surgery.{verb}: the {what} holds the parts of '{fused}' in different parameter groups "
                f"({', '.join(f'{n}: {g}' for n, g in zip(names, groups))}); one fused parameter can sit in one "
                "group only. Put them in the same group first."
            )
        keys = [sorted(st) for st in states]
        if any(k != keys[0] for k in keys):
            raise SurgeryError(
                f"surgery.{verb}: the {what}'s state for the parts of '{fused}' differs in kind "
                f"({', '.join(f'{n}: {k}' for n, k in zip(names, keys))}); one fused parameter has one state."
            )
        for key in keys[0]:
            values = [st[key] for st in states]
            if all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, parts)):
                continue
            first = values[0]
            same = all(torch.is_tensor(v) and torch.is_tensor(first) and v.shape == first.shape and torch.equal(v, first)
                       if torch.is_tensor(v) else v == first for v in values)
            if not same:
                listed = ", ".join(f"{n}: {v.tolist() if torch.is_tensor(v) and v.numel() == 1 else v}"
                                   for n, v in zip(names, values))
                raise SurgeryError(
                    f"surgery.{verb}: the {what}'s {key!r} differs between the parts of '{fused}' ({listed}); one "
                    "fused parameter has one value. Step them together, or fuse before they diverge."
                )


@dataclass
class _Move:
    """One fused parameter and its unfused parts: the old and new Parameters, and what travels with them."""

    unfusing: bool
    group: list[Slice]
    olds: list[nn.Parameter]  # unfusing: [fused]; fusing: the parts
    news: list[nn.Parameter]
    new_states: dict[int, list[dict]]  # id(optimizer) -> the state of each new parameter
    # (old tensors, new tensors, new ones copied): the weights, grads and param-shaped optimizer state
    quantities: list[tuple[list[torch.Tensor], list[torch.Tensor], bool]]

    def renamed(self, name: str, index: int) -> str:
        """A `param_names` entry of the old parameter, for the new one at `index`."""
        s = self.group[index]
        old, new = (s.fused, s.unfused) if self.unfusing else (self.group[0].unfused, s.fused)
        return name[: -len(old)] + new if name.endswith(old) else f"{name}[{new}]"


def _set_param(root: nn.Module, name: str, tensor: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    owner, _, leaf = name.rpartition(".")
    param = nn.Parameter(tensor, requires_grad=requires_grad)
    setattr(root.get_submodule(owner), leaf, param)
    return param


def _split(tensor: torch.Tensor, group: list[Slice]) -> tuple[list[torch.Tensor], bool]:
    pieces = [take(tensor, s) for s in group]
    return [p for p, _ in pieces], any(n for _, n in pieces)


def _param_shaped(value, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape


def _copy_value(value):
    return value.clone() if torch.is_tensor(value) else copy.deepcopy(value)


def _convert(
    module: nn.Module, rewrite: Rewrite, unfusing: bool, optimizers: tuple = ()
) -> tuple[nn.Module, int, list[_Move]]:
    """The other form of `module`, its slice targets filled from `module`'s parameters (grads and the optimizers'
    state carried the same way); the bytes copied; and what moved."""
    target = rewrite.build_unfused(module) if unfusing else rewrite.build_fused(module)
    copied = 0
    moves = []
    for fused_name, group in group_by_fused(rewrite.slices(module)):
        unfuse_or_fuse = _unfuse_weights if unfusing else _fuse_weights
        olds, news, quantities, n = unfuse_or_fuse(module, target, fused_name, group)
        copied += n
        new_states = _carry_optimizer_states(optimizers, olds, news, group, unfusing, quantities)
        moves.append(_Move(unfusing, group, olds, news, new_states, quantities))
    target.train(module.training)
    if not any(p.is_meta for p in module.parameters()):
        unfilled = [name for name, p in target.named_parameters() if p.is_meta]
        if unfilled:
            raise RuntimeError(f"rewrite {rewrite.name!r} built a {type(target).__name__} with {unfilled} unfilled.")
    return target, copied, moves


def _unfuse_weights(module: nn.Module, target: nn.Module, fused_name: str, group: list[Slice]):
    """One fused parameter (and its grad) sliced into `target`'s parts: `(olds, news, quantities, bytes copied)`."""
    source = _param(module, fused_name)
    # rows are views of the fused storage (a leaf multiplies by it at once); columns are contiguous copies, since a
    # column view is a non-contiguous parameter, which FSDP2 refuses ("does not support non-contiguous parameters")
    pieces = [take(source, s) for s in group]
    news = [_set_param(target, s.unfused, piece, source.requires_grad) for s, (piece, _) in zip(group, pieces)]
    quantities = [([source], news, any(n for _, n in pieces))]
    if source.grad is not None:
        grads, grads_copied = _split(source.grad, group)
        for param, grad in zip(news, grads):
            param.grad = grad
        quantities.append(([source.grad], grads, grads_copied))
    return [source], news, quantities, sum(n for _, n in pieces)


def _fuse_weights(module: nn.Module, target: nn.Module, fused_name: str, group: list[Slice]):
    """One fused parameter (and its grad) of `target` joined from `module`'s parts: as `_unfuse_weights`."""
    dim = group[0].dim
    olds = [_param(module, s.unfused) for s in group]
    whole, copied = concat(olds, dim)
    news = [_set_param(target, fused_name, whole, olds[0].requires_grad)]
    quantities = [(olds, news, copied > 0)]
    if olds[0].grad is not None:
        grads = [p.grad for p in olds]
        news[0].grad, n = concat(grads, dim)
        quantities.append((grads, [news[0].grad], n > 0))
    return olds, news, quantities, copied


def _carry_optimizer_states(optimizers: tuple, olds: list, news: list, group: list[Slice], unfusing: bool,
                            quantities: list) -> dict[int, list[dict]]:
    """Each optimizer's state of `olds`, sliced or joined as the weights were, for `news` (by optimizer id);
    values not shaped like their parameter (Adam's `step`) are copied to each."""
    dim = group[0].dim
    new_states = {}
    for opt in optimizers:
        old_states = [opt.state.get(p) for p in olds]
        if not old_states[0]:
            continue
        states: list[dict] = [{} for _ in news]
        for key, value in old_states[0].items():
            values = [st[key] for st in old_states]
            if not all(_param_shaped(v, p) for v, p in zip(values, olds)):
                for st in states:
                    st[key] = _copy_value(value)  # e.g. Adam's `step`
                continue
            if unfusing:
                parts, part_copied = _split(value, group)
            else:
                whole_value, n = concat(values, dim)
                parts, part_copied = [whole_value], n > 0
            for st, part in zip(states, parts):
                st[key] = part
            quantities.append((values, parts, part_copied))
        new_states[id(opt)] = states
    return new_states


def _release(moves: list[_Move], released: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]) -> None:
    for move in moves:
        _release_move(move, released)


def _release_move(move: _Move, released: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]) -> None:
    """Free the old tensors that the new ones copied (column splits), noting how to rebuild each on rollback.

    The old tensor objects stay (a rollback puts back the very same objects); only their storage goes.
    """
    for olds, news, copied in move.quantities:
        if not copied or any(isinstance(t, GGUFWeight) for t in olds):  # frozen GGUF bytes: nothing else holds them
            continue
        dim = move.group[0].dim
        if move.unfusing:
            rebuilds = [lambda news=news: concat([t.detach() for t in news], dim)[0]]
        else:
            rebuilds = [lambda s=s, new=news[0]: new.detach().narrow(s.dim, s.start, s.size).clone() for s in move.group]
        for old, rebuild in zip(olds, rebuilds):
            released.append((old, rebuild))
            old.data = old.detach().new_empty(0)


def _optimizer_commit(opt: torch.optim.Optimizer, moves: list[_Move]) -> Callable[[], None]:
    """Prepare `opt`'s parameter groups and state for the new parameters; return the (infallible) assignment."""
    owner = {id(p): move for move in moves for p in move.olds}
    groups = []
    for group in opt.param_groups:
        names = group.get("param_names")
        params, new_names, emitted = [], [], set()
        for i, p in enumerate(group["params"]):
            move = owner.get(id(p))
            if move is None:
                params.append(p)
                new_names.append(names[i] if names else None)
                continue
            if id(move) in emitted:
                continue
            emitted.add(id(move))
            params.extend(move.news)
            new_names.extend(move.renamed(names[i], k) if names else None for k in range(len(move.news)))
        groups.append((group, params, new_names if names else None))
    touched = [move for move in moves if any(id(p) in owner for p in move.olds)]

    def commit() -> None:
        for group, params, names in groups:
            group["params"][:] = params
            if names is not None:
                group["param_names"][:] = names
        for move in touched:
            states = move.new_states.get(id(opt))
            for old in move.olds:
                opt.state.pop(old, None)
            if states:
                for new, state in zip(move.news, states):
                    opt.state[new] = state

    return commit


def _parent_slots(model: nn.Module, ids: set[int]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every `(parent, child name)` slot that holds one of the modules in `ids`."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None and id(child) in ids:
                slots.setdefault(id(child), []).append((parent, name))
    return slots


def _swap(root: nn.Module, slots: dict, old: nn.Module, new: nn.Module, back: bool = False) -> nn.Module:
    """Put `new` wherever `old` was (`back`: put the original `new` back where `old` stands in for it); returns the
    new root if the original module was the root. `slots` stays keyed by the original modules."""
    original = new if back else old
    for parent, name in slots.get(id(original), []):
        setattr(parent, name, new)
    return new if root is old else root
