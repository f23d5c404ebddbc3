"""Swap leaves and processors, keep diffusers' classes and forwards: the one mechanism every family's rewrites use.

diffusers finds blocks by class name (`_repeated_blocks` for regional compile, `_no_split_modules` for device maps,
the cache hooks' registries) and modules by path (TaylorSeer's `^single_transformer_blocks.*attn`). So an unfused
module keeps its stock class and forward; only what differs is swapped:

- a fused Linear child becomes a leaf that computes the same function behind the same call (`SplitProjection` for a
  Linear over a concatenation, `SplitRows` for a Linear whose rows are several projections; see
  `surgery.core.split_projection`);
- where a stock attention processor reshapes by the stored head count (`unflatten(-1, (attn.heads, -1))`, wrong on
  a rank that holds `heads / N` of them), the processor is swapped, through diffusers' own extension point
  (`set_processor`), for its head-dim twin: the stock processor's own source with `(attn.heads, -1)` read as
  `(-1, head_dim)` (one rule, found by inspecting the processor: `rule_edits`), or, where the rule does not cover
  it, with the edits its family registers (`register_edits`), compiled against the stock module's globals. No processor code is copied here;
  `tests/core/test_drift.py` checks each edit still finds its text in the installed diffusers source.

`swap_rewrite` builds the `Rewrite` for one stock class: the same class in both forms, told apart by their leaves
(or processors). Its builders `recast` the module: a new instance of the same class sharing every child but the
swapped ones, so `fuse` gives back the stock structure bitwise and a failed swap leaves the original untouched.
The engine names no family: the families' files in `rewrites/` say which children and processors to swap.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from surgery.core.errors import SurgeryError
from surgery.core.registry import Rewrite
from surgery.core.slicing import Slice
from surgery.core.split_projection import (
    ATTN_PART,
    MLP_PART,
    SplitProjection,
    SplitRows,
    fused_linear_like,
    split_projection_like,
    split_projection_slices,
    split_rows_like,
    split_rows_slices,
)


def within(container: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """A recast of `container` holding `new` at the dotted `path` below it, each module on the way recast too (the
    original left as it was)."""
    head, _, rest = path.partition(".")
    return recast(container, **{head: within(getattr(container, head), rest, new) if rest else new})


def recast(module: nn.Module, cls: type[nn.Module] | None = None, **replace: nn.Module) -> nn.Module:
    """A new `cls` (default: `module`'s own class) holding `module`'s attributes, parameters, buffers and children;
    `module` is left as it was. Each keyword names a child and gives what takes its place (same name, same order), so
    a rewrite and its inverse give back `named_modules()` in diffusers' order.

    torch has no such constructor, `copy.copy` would share `_modules` itself, and the stock constructors would rebuild
    (then discard) every submodule from arguments the modules do not keep.
    """
    cls = cls or type(module)
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    machinery = set(vars(new))
    vars(new).update({k: v for k, v in vars(module).items() if k not in machinery})
    new._parameters.update(module._parameters)
    new._buffers.update(module._buffers)
    new._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    for name, child in module._modules.items():
        new._modules[name] = replace.get(name, child)
    new.training = module.training
    return new


# --- leaves ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """A fused `nn.Linear` child `name` of a module and how it splits.

    `kind="rows"`: `parts(module)` gives the output rows' parts `[(part name, rows)]`, in order (a `SplitRows`).
    `kind="columns"`: `parts(module)` gives `[(ATTN_PART, attention columns), (MLP_PART, mlp columns)]`; the input
    is `cat([attention, mlp], -1)` and the bias stays with the attention part (a `SplitProjection`).
    `parts` reads the module's attributes, the same in either form.
    """

    name: str
    kind: str
    parts: Callable[[nn.Module], list[tuple[str, int]]]

    def child(self, module: nn.Module) -> nn.Module | None:
        # a dotted name reaches into a plain container (RFD4-Proteina's `swish_linear.0`, a Linear in a Sequential)
        try:
            return module.get_submodule(self.name)
        except AttributeError:
            return None

    def fused(self, module: nn.Module) -> bool:
        # anything but the split form: a Linear, or one wrapped (PEFT, quantized), which the engine's checks refuse
        child = self.child(module)
        return child is not None and not isinstance(child, (SplitRows, SplitProjection))

    def unfused(self, module: nn.Module) -> bool:
        return type(self.child(module)) is (SplitRows if self.kind == "rows" else SplitProjection)

    def slices(self, module: nn.Module) -> list[Slice]:
        child = self.child(module)
        if self.kind == "rows":  # the module's declared sizes, either form: a resized part is caught by the engine
            return split_rows_slices(self.name, child, self.parts(module))
        return split_projection_slices(self.name, child, attn_features=self.parts(module)[0][1])

    def other_form(self, module: nn.Module) -> nn.Module:
        child = self.child(module)
        if not self.fused(module):
            return fused_linear_like(child)
        if self.kind == "rows":
            return split_rows_like(child, self.parts(module))
        return split_projection_like(child, self.parts(module)[0][1])


def rows(name: str, parts: Callable[[nn.Module], list[tuple[str, int]]]) -> Leaf:
    """A fused Linear child whose output rows are `parts(module)`, in order (q/k/v; SwiGLU gate/up)."""
    return Leaf(name, "rows", parts)


def columns(name: str, attn_features: Callable[[nn.Module], int]) -> Leaf:
    """A fused Linear child that reads `cat([attention output, mlp hidden], -1)`; `attn_features(module)` is the
    attention's width."""

    return Leaf(name, "columns", lambda m: [(ATTN_PART, attn_features(m)), (MLP_PART, -1)])


# --- twins: stock methods with listed edits, compiled from the installed diffusers source ---------------------------

# The one rule for attention processors: a processor that reshapes by the stored head count, `(attn.heads, -1)`,
# and reads `attn.heads` nowhere else (but in viewing a mask it prepared per head), splits by the head size instead, so the same code runs on the whole module and
# on a rank that holds `heads / N` of them. The head size from the module's own `head_dim`, else from its global
# widths: `inner_dim` (diffusers' generic `Attention` keeps no head_dim), else the width its `to_q` declares
# (`out_features`, the whole module's on any rank: WanAnimate2's attention keeps neither).
HEAD_SIZE = ("getattr(attn, 'head_dim', None) or (attn.inner_dim if hasattr(attn, 'inner_dim') "
             "else attn.to_q.out_features) // attn.heads")
HEADS_BY_COUNT = "(attn.heads, -1)"
HEAD_DIM = f"(-1, {HEAD_SIZE})"
# ... or by `attn.num_heads` (Kandinsky 5's `reshape(*shape, attn.num_heads, -1)`, on a module without `inner_dim`):
# the head size from the width its query projection declares (`out_features`, the whole module's on any rank)
NUM_HEADS_BY_COUNT = "attn.num_heads, -1)"
QUERY_CALL = re.compile(r"\bquery = attn\.(\w+)\(hidden_states\)")
HEAD_DIM_BY_QUERY = "-1, attn.{query}.out_features // attn.num_heads)"
# the same reshape written into a longer view, the heads last but one (`key.view(B, T, N, attn.heads, -1)`: WanAnimate's
# face adapter)
VIEW_HEADS_LAST = ", attn.heads, -1)"
VIEW_HEAD_DIM_LAST = f", -1, {HEAD_SIZE})"
# and a mask that `prepare_attention_mask` repeated once per head (the same mask for each) and the processor views
# per head: kept once, broadcast over however many heads the rank holds
MASK_BY_COUNT = "attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])"
MASK_ONCE = MASK_BY_COUNT + "[:, :1]"
# the older spelling: the head size from a local width over the stored count, `head_dim = {width} // attn.heads` with
# `{width} = key.shape[-1]` (or the query's), wrong on a share of the heads; then views and the merge by the count.
# Read as the head size from the global widths, the views and the merge by the heads the local width holds.
# (`key`, or a stream's `key_i`: HiDream's)
LOCAL_WIDTH = re.compile(r"^[ \t]*(\w+) = (query|key)\w*\.shape\[-1\][ \t]*$", re.M)
HEAD_DIM_BY_COUNT = "head_dim = {width} // attn.heads"
HEAD_DIM_GLOBAL = f"head_dim = {HEAD_SIZE}"
VIEW_BY_COUNT = "attn.heads, head_dim"
VIEW_BY_WIDTH = "{width} // head_dim, head_dim"
MERGE_BY_COUNT = "reshape(batch_size, -1, attn.heads * head_dim)"
MERGE_BY_WIDTH = "reshape(batch_size, -1, {width})"
# grouped-query attention (Lumina2): query heads per key/value head, `attn.heads // kv_heads` with the kv heads read
# off the local key width. Where the width is the query's, its heads over the local kv heads: the same ratio on a
# rank holding heads / N query heads and kv_heads / N kv heads (contiguous shards keep each group whole: query head
# i attends with kv head i // ratio, and both counts cut at the same multiples of the ratio).
GROUPS_BY_COUNT = "attn.heads // "
GROUPS_BY_WIDTH = "{width} // head_dim // "


def by_local_width(source: str) -> tuple[tuple[str, str, int], ...] | None:
    """The older spelling's edits: the one local width whose `head_dim = width // attn.heads` the source holds once."""
    widths = [m.groups() for m in LOCAL_WIDTH.finditer(source)]
    for width, projection in widths:
        head_dim = HEAD_DIM_BY_COUNT.format(width=width)
        if [w for w, _ in widths].count(width) != 1 or source.count(head_dim) != 1:
            continue
        edits = ((head_dim, HEAD_DIM_GLOBAL, 1),
                 (VIEW_BY_COUNT, VIEW_BY_WIDTH.format(width=width), source.count(VIEW_BY_COUNT)))
        if MERGE_BY_COUNT in source:
            edits += ((MERGE_BY_COUNT, MERGE_BY_WIDTH.format(width=width), source.count(MERGE_BY_COUNT)),)
        if projection == "query" and GROUPS_BY_COUNT in source:
            edits += ((GROUPS_BY_COUNT, GROUPS_BY_WIDTH.format(width=width), source.count(GROUPS_BY_COUNT)),)
        return edits
    return None


# Edits the rule does not cover: `(stock text, replacement, occurrences)`, keyed by the stock method; empty here (the
# engine names no family), filled by the families' `register_edits` as `import surgery` loads them. The stock text
# must occur exactly `occurrences` times, or the twin is not built (and tests/core/test_drift.py fails): a diffusers
# release that changes the original is noticed, not silently copied around.
EDITS: dict[str, tuple[tuple[str, str, int], ...]] = {}


def register_edits(stock: type, method: str, edits: tuple[tuple[str, str, int], ...]) -> None:
    """List the edits of `stock.<method>` that `twin` applies, where the processor rule does not cover it."""
    EDITS[f"{qualified(stock)}.{method}"] = tuple(edits)


def rule_edits(stock: type, method: str = "__call__") -> tuple[tuple[str, str, int], ...] | None:
    """The processor rule's edits of `stock.<method>`, or None where it does not apply (no reshape by the stored
    head count, or `attn.heads` read elsewhere: the rule cannot tell what that use means on a share of the heads).

    Three spellings of the reshape are read: `unflatten(-1, (attn.heads, -1))` (also as the last two sizes of a
    longer `view(..., attn.heads, -1)`; or `attn.num_heads, -1)` with the head size from the query projection's width:
    Kandinsky 5), and the older processors' `head_dim = inner_dim // attn.heads` from the key's (or the query's)
    width, then `view(..., attn.heads, head_dim)` and `reshape(..., attn.heads * head_dim)` (SD3's joint, CogVideoX's,
    diffusers' generic processors; Lumina2's grouped-query one, whose `attn.heads // kv_heads` is read by the query
    width too)."""
    source = inspect.getsource(getattr(stock, method))
    masks = source.count(MASK_BY_COUNT)
    if masks and "prepare_attention_mask" not in source:  # a mask of another origin may differ per head
        return None
    mask = ((MASK_BY_COUNT, MASK_ONCE, masks),) if masks else ()
    queries = set(QUERY_CALL.findall(source))
    if HEADS_BY_COUNT in source:
        edits = ((HEADS_BY_COUNT, HEAD_DIM, source.count(HEADS_BY_COUNT)),)
        if VIEW_HEADS_LAST in source:
            edits += ((VIEW_HEADS_LAST, VIEW_HEAD_DIM_LAST, source.count(VIEW_HEADS_LAST)),)
    elif NUM_HEADS_BY_COUNT in source and len(queries) == 1:
        by_query = HEAD_DIM_BY_QUERY.format(query=queries.pop())
        edits = ((NUM_HEADS_BY_COUNT, by_query, source.count(NUM_HEADS_BY_COUNT)),)
    else:
        edits = by_local_width(source)
        if edits is None:
            return None
    rest = source
    for old, _, _ in edits + mask:
        rest = rest.replace(old, "")
    return None if "attn.heads" in rest or "attn.num_heads" in rest else edits + mask


def edits_for(stock: type, method: str = "__call__") -> tuple[tuple[str, str, int], ...] | None:
    """The edits `twin` applies to `stock.<method>`: those listed for it, else the processor rule's."""
    return EDITS.get(f"{qualified(stock)}.{method}") or rule_edits(stock, method)


_twins: dict[type, type] = {}
TWIN_METHODS = "_surgery_twin_methods"  # the class attribute a twin lists its edited methods under
_stocks: dict[type, type] = {}


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def edited_source(stock: type, method: str = "__call__") -> str:
    """The source of `stock.<method>` with its listed edits applied; raises if any edit no longer fits."""
    key = f"{qualified(stock)}.{method}"
    edits = edits_for(stock, method)
    if edits is None:
        raise SurgeryError(f"{key} reshapes by no `{HEADS_BY_COUNT}` alone (the processor rule) and has no edits "
                           "listed; list them with surgery.extend.register_edits.")
    source = textwrap.dedent(inspect.getsource(getattr(stock, method)))
    for old, new, count in edits:
        found = source.count(old)
        if found != count:
            raise SurgeryError(
                f"{key} holds {old!r} {found} times, not {count}: the installed diffusers changed it. Review "
                "its edits (surgery.extend.register_edits, or the processor rule) against its new source."
            )
        source = source.replace(old, new)
    return source


def twin(stock: type, name: str, method: str | tuple[str, ...] = "__call__") -> type:
    """A subclass of `stock` named `name` whose `method` (or each of several) is the stock one with its listed edits,
    compiled against the stock module's globals. Registered with diffusers' processor and block registries under the
    stock class's metadata (the layer-skip and cache hooks look classes up exactly)."""
    if stock in _twins:
        return _twins[stock]
    methods = (method,) if isinstance(method, str) else tuple(method)
    namespace: dict = {}
    for each in methods:
        code = compile(edited_source(stock, each), f"<{name}: {qualified(stock)}.{each} edited by surgery.core.leaves>",
                       "exec")
        # the defining module's globals, not a decorator's (transformers wraps forwards in `deprecate_kwarg`)
        exec(code, inspect.unwrap(getattr(stock, each)).__globals__, namespace)
    cls = type(name, (stock,), {
        **{each: namespace[each] for each in methods},
        TWIN_METHODS: methods,
        "__module__": __name__,
        "__doc__": f"`{qualified(stock)}` with the edits of surgery.core.leaves.edits_for.",
    })
    try:  # diffusers' hooks find a processor's or a block's metadata by its exact class; the twin shares the stock one's
        from diffusers.hooks._helpers import AttentionProcessorRegistry, TransformerBlockRegistry

        for registry in (AttentionProcessorRegistry, TransformerBlockRegistry):
            try:
                registry.register(cls, registry.get(stock))
            except ValueError:
                pass
    except ImportError:
        pass
    _twins[stock], _stocks[cls] = cls, stock
    return cls


def twin_methods(cls: type) -> tuple[str, ...]:
    """The methods a twin made by `twin` edits."""
    return vars(cls)[TWIN_METHODS]


def head_dim_twin(stock: type) -> type:
    """The twin of processor class `stock` whose heads are split by `head_dim`: the same code runs on the whole module
    and on each rank's share of the heads."""
    return twin(stock, f"HeadDim{stock.__name__}")


def runs_twin(module: nn.Module) -> bool:
    """Whether `module` runs a twin processor made here (heads split by `head_dim`: it can run column-sharded)."""
    return is_twin(getattr(module, "processor", None))


def is_twin(processor) -> bool:
    """Whether `processor` is a twin made here (heads split by `head_dim`)."""
    return type(processor) in _stocks


def translate(processor, unfusing: bool):
    """`processor` as its twin (unfusing) or its stock class (fusing), keeping its state (attention backend, context
    parallel config); any other processor is returned as is."""
    cls = type(processor)
    counterpart = _twins.get(cls) if unfusing else _stocks.get(cls)
    if counterpart is None:
        return processor
    translated = counterpart.__new__(counterpart)
    translated.__dict__.update(processor.__dict__)
    return translated


def set_processor(attention: nn.Module, processor) -> None:
    """diffusers' `set_processor` where the attention has it; an attention written as a plain `nn.Module` that calls
    `self.processor` (Mochi's) takes the attribute."""
    if hasattr(attention, "set_processor"):
        attention.set_processor(processor)
    else:
        attention.processor = processor


@dataclass(frozen=True)
class Processors:
    """The stock processor classes of some attention modules that need head-dim twins (built on creation)."""

    stock: tuple[type, ...]
    twins: tuple[type, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "twins", tuple(head_dim_twin(cls) for cls in self.stock))

    def fused(self, attention: nn.Module) -> bool:
        return type(getattr(attention, "processor", None)) in self.stock

    def unfused(self, attention: nn.Module) -> bool:
        return type(getattr(attention, "processor", None)) in self.twins

    def swapped(self, attention: nn.Module, unfusing: bool) -> nn.Module:
        """A recast of `attention` running the other form's processor (itself, where its processor is neither)."""
        if not (self.fused(attention) if unfusing else self.unfused(attention)):
            return attention
        new = recast(attention)
        set_processor(new, translate(attention.processor, unfusing))
        return new


# --- the rewrite -------------------------------------------------------------------------------------------------


def swap_rewrite(
    name: str,
    cls: type[nn.Module],
    leaves: tuple[Leaf, ...] = (),
    processors: Processors | None = None,
    children: dict[str, Processors | Callable[[nn.Module, bool], nn.Module]] | None = None,
    check: Callable[[nn.Module, str, str], None] | None = None,
    unfused_class: type[nn.Module] | None = None,
) -> Rewrite:
    """The rewrite of a stock `cls` whose `leaves` are swapped (and whose own processor, where `processors` is given,
    is swapped for its twin); the class, the forward and every other child stay.

    `children` converts children along (the engine does not visit modules nested in one it rewrites): a `Processors`
    swaps that child attention's processor; a function `fn(child, unfusing)` returns the child in the new form
    (itself where nothing changes). The form is told by the leaves (all fused Linears / all split), or, for a module
    without leaves, by its own and its children's processors, or, with neither, by what the children's converters
    would change (a stock `nn.RMSNorm` across heads is the fused form). `unfused_class`, only where the stock forward itself
    cannot run the leaves (a `twin` of `cls`): the unfused form's class; `unfuse` then names it beside the stock one
    in the model's `_repeated_blocks` and `_no_split_modules` (surgery.integration.interop).
    """
    unfused_class = unfused_class or cls
    children = dict(children or {})
    twins = [(c, p) for c, p in children.items() if isinstance(p, Processors)]

    def processor_forms(m: nn.Module, unfusing: bool) -> list[bool]:
        own = [processors] if processors is not None else []
        found = [(m, p) for p in own] + [(getattr(m, c), p) for c, p in twins if getattr(m, c, None) is not None]
        return [p.fused(a) if unfusing else p.unfused(a) for a, p in found]

    converters = [(c, f) for c, f in children.items() if not isinstance(f, Processors)]

    def converts(m: nn.Module, unfusing: bool) -> bool:
        # a module with neither leaves nor processors (only its q/k norms swap) is told by what its children's
        # converters would change
        return any(f(getattr(m, c), unfusing) is not getattr(m, c) for c, f in converters
                   if getattr(m, c, None) is not None)

    told_by_children = not leaves and processors is None and not twins

    def fused(m: nn.Module) -> bool:
        if leaves:
            return all(leaf.fused(m) for leaf in leaves)
        return converts(m, True) if told_by_children else any(processor_forms(m, True))

    def unfused(m: nn.Module) -> bool:
        if leaves:
            return all(leaf.unfused(m) for leaf in leaves)
        if told_by_children:
            return not converts(m, True) and converts(m, False)
        return not any(processor_forms(m, True)) and any(processor_forms(m, False))

    def slices(m: nn.Module) -> list[Slice]:
        return [s for leaf in leaves for s in leaf.slices(m)]

    def build(m: nn.Module, unfusing: bool) -> nn.Module:
        replace = {}
        for leaf in leaves:
            head, _, rest = leaf.name.partition(".")
            replace[head] = within(getattr(m, head), rest, leaf.other_form(m)) if rest else leaf.other_form(m)
        for child, convert in children.items():
            if getattr(m, child, None) is not None:
                convert = convert.swapped if isinstance(convert, Processors) else convert
                replace[child] = convert(getattr(m, child), unfusing)
        new = recast(m, unfused_class if unfusing else cls, **replace)
        if processors is not None and (processors.fused(m) if unfusing else processors.unfused(m)):
            set_processor(new, translate(m.processor, unfusing))
        return new

    return Rewrite(
        name=name,
        fused=cls,
        unfused=unfused_class,
        slices=slices,
        build_unfused=lambda m: build(m, True),
        build_fused=lambda m: build(m, False),
        is_fused=fused,
        is_unfused=unfused,
        check=check or (lambda m, path, verb: None),
    )
