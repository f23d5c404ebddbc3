"""Tensor-parallel plans derived from diffusers' shared building blocks; names no family.

diffusers builds its DiTs from a few parts, so a module of a transformer block that no family plans is read off:

- an attention (`Attention`, `AttentionModuleMixin`, or any module with an integer `heads` and a `to_q` Linear):
  `to_q/k/v` and `add_q/k/v_proj` colwise, `to_out.0` (or a Linear `to_out`) and `to_add_out` rowwise (one all-reduce each); a q/k norm over
  `head_dim` acts on each rank's own heads (`per_head_norm`); a norm over the whole width (`rms_norm_across_heads`)
  gets `AcrossHeadsNorm`, whose statistic is one all-reduce of a number per token, never an all-gather of q/k. Its
  processor must split heads by `head_dim` (`surgery.core.leaves`: the twin `unfuse` installs, or a stock processor
  that never reads `attn.heads`);
- diffusers' `FeedForward` keeps its registered plan (`rewrites/diffusers_common.py`).

What the derivation does not understand (a Linear it has no rule for, a processor that reads the head count, a norm
of another width, a norm written with `F.rms_norm`) is refused with the module's path and what was found: `derived`
returns `Refused(reason)`, and `tensor_parallel` names it when a block Linear is left without a plan.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from surgery.core.checks import mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.core.heads_padding import refusal_hint
from surgery.core.leaves import is_twin, runs_twin
from surgery.core.norms import ElementwiseLayerNorm, ElementwiseRMSNorm
from surgery.core.registry import rotary_inputs_for
from surgery.core.split_projection import SplitProjection
from surgery.parallel.dtensor_attention import ImplicitReplication
from surgery.parallel.styles import SPLIT_PROJECTION_TP_PLAN, under

# the styles a family's plan may name (`surgery plan --show-plan` prints them; they have literal forms)
__all__ = ["AcrossHeadsNorm", "ColwiseIntoHeads", "DepthwiseChannels", "HeadsInputs", "PerHeadParameters",
           "RowwiseIntoHeads"]

# diffusers' spellings of an attention's parts, each read as its role so that no family names them: its shared
# `Attention`'s, the `_t` (text stream) and `*_rms_norm` ones of attentions written beside their model (HiDream's),
# Kandinsky 5's `to_query/to_key/to_value/out_layer` and `query_norm/key_norm`, LongCat-AudioDiT's `q_norm/k_norm`;
# the head count as `heads` or `num_heads`
QUERIES = ("to_q", "to_query")
KEYS = ("to_k", "add_k_proj", "to_key")
INPUT_PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_q_t", "to_k_t", "to_v_t",
                     "to_query", "to_key", "to_value")
OUTPUT_PROJECTIONS = ("to_out.0", "to_add_out", "to_out", "to_out_t", "out_layer")  # `to_out` where it is the Linear
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k", "q_rms_norm", "k_rms_norm", "q_rms_norm_t",
            "k_rms_norm_t", "query_norm", "key_norm", "q_norm", "k_norm")
HEAD_COUNTS = ("heads", "num_heads")
# `Attention`'s methods that reshape by its stored head count (`self.heads`): a processor calling them reads it too
# (diffusers' `AttnProcessor`, which `Attention(scale_qk=False)` sets)
HEAD_COUNT_METHODS = ("head_to_batch_dim", "batch_to_head_dim")


def per_head_norm(head_dim: int = 2) -> SequenceParallel:
    """The style for a norm applied to each rank's own heads (QK-norm on `[batch, seq, heads, head_dim]`).

    Its weight becomes a replicated DTensor and its input is declared sharded on the heads dim, so gradients of the
    weight are summed over ranks; no collective runs in forward.
    """
    return SequenceParallel(sequence_dim=head_dim, use_local_output=True)


def rows_sharded(src_data_rank: int | None):
    """`distribute_module`'s partition: each module's own parameters not yet placed `Shard(0)`."""

    def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(mod.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                placed = distribute_tensor(param, mesh, (Shard(0),), src_data_rank=src_data_rank)
                mod.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))

    return partition


class AcrossHeadsNorm(ParallelStyle):
    """A norm over the whole attention width on a rank that holds a share of the heads: its weight (and bias)
    `Shard(0)`, its input this rank's columns as a `Shard(-1)` DTensor, its output local again (a DTensor with
    `use_local_output=False`, where the processor runs on DTensors). The module computes in elementwise ops and means
    (diffusers' `RMSNorm`, `surgery.core.norms.ElementwiseRMSNorm` / `ElementwiseLayerNorm`), so each mean over the
    sharded width is a partial sum that DTensor resolves with one all-reduce of `[batch, tokens, 1]`: `statistics`
    of them per call (an RMS norm's one, a layer norm's two: its mean and its variance)."""

    def __init__(self, use_local_output: bool = True, statistics: int = 1):
        super().__init__()
        self.use_local_output = use_local_output
        self.statistics = statistics

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, (Shard(-1),), run_check=False) if not isinstance(a, DTensor)
                         else a for a in args)

        def outputs(mod, out, mesh):
            return out.to_local() if isinstance(out, DTensor) and self.use_local_output else out

        return distribute_module(module, mesh, rows_sharded(self.src_data_rank), inputs, outputs)


class PerHeadParameters(ParallelStyle):
    """A module's own per-head tensors (`names`, one entry per head: Lumina-Next's block `gate` over its
    cross-attention's heads) where its attentions run on DTensors: each `Shard(0)`, split like the heads. The module's
    forward meets them with the attention outputs, heads-sharded DTensors, so each rank multiplies its own heads' share;
    no collective. On any other tensor DTensor raises (a DTensor met with a plain tensor), never a silent mismatch."""

    def __init__(self, *names: str):
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = module.get_parameter(name)
            if not isinstance(param, DTensor):
                placed = distribute_tensor(param, mesh, (Shard(0),), src_data_rank=self.src_data_rank)
                module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
        return module


class DepthwiseChannels(ParallelStyle):
    """A depthwise convolution module (one filter per channel: SANA-WM's temporal short convolutions over q/k/v)
    whose channels are the attention width of a rank's share of the heads: its parameters `Shard(0)` (its filters of
    those channels), its first input this rank's columns as a `Shard(-1)` DTensor, its output local again. The stock
    forward runs on DTensors, its convolution on each rank's own channels (`register_depthwise_convolution`): no
    collective."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        register_depthwise_convolution()

        def inputs(mod, args, mesh):
            first, *rest = args
            if not isinstance(first, DTensor):
                first = DTensor.from_local(first, mesh, (Shard(-1),), run_check=False)
            return (first, *rest)

        def outputs(mod, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, mesh, rows_sharded(self.src_data_rank), inputs, outputs)


@functools.cache
def register_depthwise_convolution() -> None:
    """DTensor convolves with the weight whole (torch's handler shards the batch or the width of an image, with halo
    exchange); a depthwise convolution (`groups` = channels, one filter each) over channel-sharded input `Shard(1)`
    with its weight `Shard(0)` is each rank's own channels, convolved with its own filters and `groups` = its own
    channel count, forward and backward. Anything else goes to torch's handlers as before."""
    aten = torch.ops.aten
    handlers = DTensor._op_dispatcher._custom_op_handlers
    stock_forward, stock_backward = handlers[aten.convolution.default], handlers[aten.convolution_backward.default]

    def by_channels(x, weight, groups) -> bool:
        return (isinstance(x, DTensor) and isinstance(weight, DTensor) and x.device_mesh.ndim == 1
                and tuple(x.placements) == (Shard(1),) and tuple(weight.placements) == (Shard(0),)
                and groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1)

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    def wrap(t, mesh, placement):
        return None if t is None else DTensor.from_local(t, mesh, (placement,), run_check=False)

    def forward(op_call, args, kwargs):
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
        if not by_channels(x, weight, groups) or (bias is not None and tuple(bias.placements) != (Shard(0),)):
            return stock_forward(op_call, args, kwargs)
        out = op_call(local(x), local(weight), local(bias), stride, padding, dilation, transposed, output_padding,
                      local(x).shape[1])
        return wrap(out, x.device_mesh, Shard(1))

    def backward(op_call, args, kwargs):
        grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
        if not by_channels(x, weight, groups):
            return stock_backward(op_call, args, kwargs)
        mesh, channels = x.device_mesh, local(x).shape[1]
        grad = grad.redistribute(mesh, (Shard(1),)) if isinstance(grad, DTensor) else grad
        grads = op_call(local(grad), local(x), local(weight), None if bias_sizes is None else [channels], stride,
                        padding, dilation, transposed, output_padding, channels, mask)
        return tuple(wrap(g, mesh, p) for g, p in zip(grads, (Shard(1), Shard(0), Shard(0))))

    handlers[aten.convolution.default] = forward
    handlers[aten.convolution_backward.default] = backward


class ColwiseIntoHeads(ColwiseParallel):
    """`ColwiseParallel` whose output stays a heads-sharded DTensor (`use_local_output=False`), to meet a module's
    `PerHeadParameters` (SANA-WM's `gate_proj` rows with `A_log` and `dt_bias`), its gradient made contiguous on the
    way back: the forward may transpose it (the decay gate, `(batch, frames, heads)` -> `(batch, heads, frames)`), and
    DTensor's Linear backward then views a transposed local shard, which torch 2.13 refuses. No collective."""

    def __init__(self):
        super().__init__(use_local_output=False)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        if outputs.requires_grad:  # DTensor's `contiguous` reads the wrapper's strides, not the local shard's
            outputs.register_hook(lambda grad: DTensor.from_local(grad.to_local().contiguous(), grad.device_mesh,
                                                                  grad.placements, run_check=False))
        return outputs


class HeadsInputs(ParallelStyle):
    """The positional arguments of a module that computes on a rank's share of the heads with plain tensors (SANA-WM's
    recurrences, `attn` and `cam_attn`): at `local` positions a heads-sharded DTensor made before it (the decay gate)
    enters as this rank's local heads; at `whole` positions tensors every rank holds whole (the UCPE ray transforms,
    made of the camera conditions, or a tuple of them) enter as they are, their gradients, each rank's part from its
    own heads, summed over the ranks on the way back (an all-reduce in backward only, where they need a gradient).
    No collective in forward."""

    def __init__(self, local: tuple[int, ...] = (), whole: tuple[int, ...] = ()):
        super().__init__()
        self.local, self.whole = local, whole

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def summed(tensor):
            if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor) or not tensor.requires_grad:
                return tensor
            return DTensor.from_local(tensor, mesh, (Replicate(),), run_check=False).to_local(
                grad_placements=(Partial(),))

        def prepare(_, args):
            args = list(args)
            for i in self.local:
                args[i] = args[i].to_local() if isinstance(args[i], DTensor) else args[i]
            for i in self.whole:
                args[i] = type(args[i])(map(summed, args[i])) if isinstance(args[i], (tuple, list)) else summed(args[i])
            return tuple(args)

        module.register_forward_pre_hook(prepare)
        return module


class RowwiseIntoHeads(RowwiseParallel):
    """`RowwiseParallel` whose all-reduced output each rank keeps only its own heads' columns of (a local slice, no
    further collective): a Linear whose output is added to a heads-sharded activation before the output projection
    (SANA-WM's camera branch, `out_proj_cam`, into the main branch's attention output). Its all-reduce is the
    Rowwise one; a reduce-scatter would move half the bytes but is no all-reduce of the library's count."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        whole = outputs.redistribute(placements=output_layouts)
        share = whole.redistribute(placements=(Shard(-1),))
        return share.to_local() if use_local_output else share


class RotaryAcrossWidth(ParallelStyle):
    """An attention's rotary tables, where its processor rotates q and k across the whole attention width before
    splitting heads (LTX-Video, LTX-2): column-sharded q/k hold this rank's heads, a contiguous share of the width, so
    their cos/sin must be the same share. Every rank holds the tables whole (`Replicate`); the module gets its `Shard`
    of each, a local slice (no communication): a `[batch, tokens, heads x head_dim]` table on its last dim, a
    `[batch, heads, tokens, head_dim / 2]` one (diffusers' "split" layout, whose processor reads the head count off
    `cos.shape[1]`) on its heads dim. `names` are the forward's arguments that carry `(cos, sin)` tuples or None.

    Stock `PrepareModuleInput` does the same Replicate -> Shard step for a keyword argument holding one tensor; it
    refuses these, a tuple of two tensors (and None, for a cross-attention called without rotary), and it would miss
    one passed by position; so this style binds the forward's signature and maps the step over each tuple."""

    def __init__(self, *names: str):
        super().__init__()
        self.names = names

    @staticmethod
    def table_dim(table) -> int:
        return 1 if table.ndim == 4 else table.ndim - 1

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        signature = inspect.signature(module.forward)
        where = type(module).__name__

        def local(table):
            dim = self.table_dim(table)
            if table.shape[dim] % mesh.size():
                raise SurgeryError(f"surgery.tensor_parallel: a {where}'s rotary table of shape {tuple(table.shape)} "
                                   f"has {table.shape[dim]} entries on dim {dim}, which a mesh of {mesh.size()} cannot "
                                   "split like its heads. Use a mesh size that divides its heads.")
            whole = DTensor.from_local(table, mesh, (Replicate(),), run_check=False)
            return whole.redistribute(mesh, (Shard(dim),)).to_local()

        # a name the forward takes through its **kwargs (passed on to the processor) is found there
        extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

        def shares(_, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            for name in self.names:
                holder = bound.arguments if name in signature.parameters else bound.arguments.get(extra, {})
                tables = holder.get(name)
                if tables is not None:
                    holder[name] = type(tables)(local(t) for t in tables)
            return bound.args, bound.kwargs

        module.register_forward_pre_hook(shares, with_kwargs=True)
        return module


class OwnedColwise(ColwiseParallel):
    """`ColwiseParallel` whose local output is a tensor of its own rather than the DTensor's local view: a processor
    that writes into q/k in place (`query[:, :, n:] = rotary(...)`) may not modify a view autograd made for the
    DTensor-to-local step. One copy of the projection's output per call; no collective."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        local = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return local.clone() if use_local_output else local


# `query[...] = ...`: a processor writing into a slice of q/k/v after the projection
WRITES_INTO_PROJECTION = re.compile(r"\b(query|key|value)\[[^\]\n]*\]\s*=[^=]")


def processor_writes_in_place(processor) -> bool:
    """Whether a processor (or the stock class a head-dim twin derives from) writes into a slice of q/k/v."""
    for cls in type(processor).__mro__:
        if "__call__" in vars(cls):
            try:
                if WRITES_INTO_PROJECTION.search(inspect.getsource(cls.__call__)):
                    return True
            except (OSError, TypeError):
                continue
    return False


@dataclass(frozen=True)
class Refused:
    """Why a module's plan cannot be derived: one line naming what was found."""

    reason: str


def head_count(module: nn.Module) -> int | None:
    """An attention's stored head count (`heads`, or `num_heads`), or None."""
    return next((n for n in (getattr(module, a, None) for a in HEAD_COUNTS) if isinstance(n, int)), None)


def query_projection(module: nn.Module) -> nn.Module | None:
    """An attention's query projection (`to_q`, or `to_query`), or None."""
    return next((q for q in (getattr(module, name, None) for name in QUERIES) if q is not None), None)


def is_attention(module: nn.Module) -> bool:
    return isinstance(module, (Attention, AttentionModuleMixin)) or (
        head_count(module) is not None and isinstance(query_projection(module), nn.Linear))


def _child(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def norm_width(norm: nn.Module) -> int | None:
    """The width a norm normalizes over, from its shape (weight or `normalized_shape` / `dim`)."""
    weight = getattr(norm, "weight", None)
    if weight is not None:
        return int(weight.shape[-1])
    shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
    if shape is None:
        return None
    return int(shape[-1] if isinstance(shape, (tuple, list)) or hasattr(shape, "__len__") else shape)


def qk_norms_per_head(module: nn.Module) -> bool:
    """Whether an attention module's q/k norms (where it has any) each normalize one head's `head_dim` features: a
    shared plan written for per-head norms fits it; a norm across heads needs the derived `AcrossHeadsNorm`."""
    heads, q = head_count(module), query_projection(module)
    if heads is None or not isinstance(q, nn.Linear):
        return True
    norms = [_child(module, name) for name in QK_NORMS]
    return all(norm_width(norm) in (None, q.out_features // heads) for norm in norms
               if norm is not None and not isinstance(norm, nn.Identity))


def head_count_reader(processor, seen: frozenset = frozenset()) -> tuple[type, str] | None:
    """What, in the code `processor` runs, reads the stored head count (wrong on a rank that holds a share of the
    heads), as (class, how the processor runs it); None where nothing does. That code is every `__call__` of its
    class's MRO (an override may call `super().__call__`) and of the callables it holds (a wrapper's inner
    processor, followed the same way); a twin made here splits heads by `head_dim`. Code without source to read
    counts as reading it."""
    if is_twin(processor) or id(processor) in seen:
        return None
    seen = seen | {id(processor)}
    if inspect.ismethod(processor) or inspect.isfunction(processor):
        owner = getattr(processor, "__self__", None)
        calls = [(type(owner) if owner is not None else processor, processor)]
    else:
        calls = [(cls, vars(cls)["__call__"]) for cls in type(processor).__mro__ if "__call__" in vars(cls)]
    for cls, call in calls:
        try:
            source = inspect.getsource(call)
        except (OSError, TypeError):
            return cls, "has no source to read"
        if any(f"attn.{count}" in source for count in HEAD_COUNTS + HEAD_COUNT_METHODS):
            return cls, "" if cls is type(processor) else f"derives from {cls.__name__}"
    for name, value in getattr(processor, "__dict__", {}).items():
        if callable(value) and not isinstance(value, (type, nn.Module)):
            found = head_count_reader(value, seen)
            if found is not None:
                return found[0], f"runs {found[0].__name__} (its `{name}`)"
    return None


def processor_reads_head_count(processor) -> bool:
    """Whether a processor's code reads the stored head count (see `head_count_reader`)."""
    return head_count_reader(processor) is not None


def runs_on_dtensors(module: nn.Module) -> bool:
    """Whether an attention's processor must run on DTensor q/k/v (`surgery.parallel.dtensor_attention`): it reads
    the stored head count and no head-dim twin runs in its place. The twin, where it runs, is the faster path (no
    DTensor dispatch per op in eager mode)."""
    processor = getattr(module, "processor", None)
    return processor is not None and not runs_twin(module) and processor_reads_head_count(processor)


# an attention's key and value projections, pair by pair, in the spellings of `INPUT_PROJECTIONS`
KEY_VALUE_PAIRS = (("to_k", "to_v"), ("add_k_proj", "add_v_proj"), ("to_k_t", "to_v_t"), ("to_key", "to_value"))


def whole_key_values(module: nn.Module) -> tuple[str, ...]:
    """The key/value projections of a multi-query attention (one key/value head for all its query heads) whose
    processor runs on DTensors: they stay whole on every rank, since one head cannot be split. The stock processor
    then repeats that head over the query heads as a replicated DTensor, and attention takes each rank's share of the
    copies (a local slice, no collective); only the query heads and the output projection are split."""
    heads, q = head_count(module), query_projection(module)
    if not heads or heads == 1 or not isinstance(q, nn.Linear) or not runs_on_dtensors(module):
        return ()
    head_dim = q.out_features // heads
    return tuple(name for pair in KEY_VALUE_PAIRS if isinstance(_child(module, pair[0]), nn.Linear)
                 and _child(module, pair[0]).out_features == head_dim for name in pair)


def attention_plan(module: nn.Module) -> dict | Refused:
    """The derived plan of one attention module (keys relative to it), or why there is none: its projections' and
    norms' plan (`projection_plan`); where its processor reads the stored head count and no head-dim twin runs, the
    same on DTensors, the module itself under `ImplicitReplication` (the stock processor runs as it is)."""
    processor = getattr(module, "processor", None)
    reader = head_count_reader(processor) if processor is not None else None
    if reader is not None and reader[1]:  # a wrapper or subclass: not the stock code a twin or DTensors are proven on
        return Refused(f"its processor {type(processor).__name__} {reader[1]}, which reads the stored head count "
                       "`attn.heads` (or has no source to read), and surgery gives only a stock processor its head-dim "
                       "twin. Set the stock processor back before sharding, or set yours after surgery.unfuse around "
                       "the processor it installs (attention.processor)")
    if runs_on_dtensors(module):
        plan = projection_plan(module, on_dtensors=True)
        return plan if isinstance(plan, Refused) else {**plan, "": ImplicitReplication()}
    processor = getattr(module, "processor", None)
    plan = projection_plan(module)
    if processor is not None and not isinstance(plan, Refused) and processor_writes_in_place(processor):
        plan = {k: OwnedColwise() if type(v) is ColwiseParallel else v for k, v in plan.items()}
    rotary = rotary_inputs_for(module)
    if rotary and not isinstance(plan, Refused):
        plan = {**plan, "": RotaryAcrossWidth(*rotary)}
    return plan


def projection_plan(module: nn.Module, on_dtensors: bool = False) -> dict | Refused:
    """The styles of an attention module's projections and q/k norms, read off its children, or why there are
    none (a Linear without a rule, a norm of another width, a torch RMSNorm across heads).

    `on_dtensors`: for a processor that runs on DTensors (`runs_on_dtensors`): q/k/v and gates leave their Linears
    as DTensors, a gate may be as wide as q (Krea2's sigmoid gate over the attention output), per-head norms and the
    module's own parameters are left to `ImplicitReplication` (replicated weights)."""
    colwise = functools.partial(ColwiseParallel, use_local_output=not on_dtensors)
    cls = type(module).__name__
    heads = head_count(module)
    q = query_projection(module)
    if heads is None or not isinstance(q, nn.Linear):
        return Refused(f"a {cls} without an integer `heads` and a `to_q` Linear (fused to_qkv? call surgery.unfuse)")
    head_dim = q.out_features // heads
    plan: dict = {}
    whole = whole_key_values(module) if on_dtensors else ()  # replicated by the module's `ImplicitReplication`
    for name in INPUT_PROJECTIONS:
        if isinstance(_child(module, name), nn.Linear) and name not in whole:
            plan[name] = colwise()
    for name in OUTPUT_PROJECTIONS:
        if isinstance(_child(module, name), nn.Linear):
            plan[name] = RowwiseParallel()
    gates = (heads, q.out_features) if on_dtensors else (heads,)
    for name, child in module.named_children():  # per-head gates: rows are heads, split like q's
        if (name not in plan and name not in whole and isinstance(child, nn.Linear) and child.out_features in gates
                and (child.in_features == q.in_features or (on_dtensors and child.out_features == heads))):
            # on DTensors, a per-head term from another input too (RFD4-Proteina's pair bias, pair width -> heads):
            # its Shard(-1) output meets the heads wherever the stock processor moves them
            plan[name] = colwise()
    for name in QK_NORMS:
        norm = _child(module, name)
        if norm is None or isinstance(norm, nn.Identity):
            continue
        width = norm_width(norm)
        if width == head_dim:
            if any(True for _ in norm.parameters(recurse=False)) and not on_dtensors:
                plan[name] = per_head_norm(2)
        elif width is not None and width % head_dim == 0 and width > head_dim:
            if type(norm) is nn.RMSNorm:
                return Refused(f"{name} is a torch.nn.RMSNorm across heads ({width} = heads x {head_dim}); its "
                               "F.rms_norm would all-gather q/k. surgery.unfuse swaps it for ElementwiseRMSNorm "
                               "where the family's rewrite says so")
            if type(norm) is nn.LayerNorm:
                return Refused(f"{name} is a torch.nn.LayerNorm across heads ({width} = heads x {head_dim}); its "
                               "F.layer_norm cannot run on a share of the width. surgery.unfuse swaps it for "
                               "ElementwiseLayerNorm where the family's rewrite says so (norms_across_heads)")
            if not isinstance(norm, (ElementwiseRMSNorm, ElementwiseLayerNorm)) and type(norm).__name__ != "RMSNorm":
                return Refused(f"{name} is a {type(norm).__name__} across heads ({width} wide): only RMS and layer "
                               "norms written in elementwise ops shard by their statistics")
            plan[name] = AcrossHeadsNorm(use_local_output=not on_dtensors,
                                         statistics=getattr(norm, "statistics", 1))
        else:
            return Refused(f"{name} normalizes {width} features, neither the head size {head_dim} nor a multiple")
    for name, param in [] if on_dtensors else module.named_parameters(recurse=False):
        # a tensor the processor reads directly (Helios' `history_key_scale`, one scale per head): a rank holding a
        # share of the heads would need its share of it, which no derived style gives
        return Refused(f"its own parameter `{name}` {tuple(param.shape)} has no derivation rule (a per-head tensor "
                       "the processor reads would need this rank's share of the heads)")
    covered = set(plan) | set(whole)
    for path, child in module.named_modules():
        if isinstance(child, nn.Linear) and path and not any(path == c or path.startswith(c + ".") for c in covered):
            return Refused(f"its Linear `{path}` ({child.in_features} -> {child.out_features}) has no derivation rule "
                           f"(not one of {', '.join(INPUT_PROJECTIONS + OUTPUT_PROJECTIONS)})")
    for name in KEYS:
        k = _child(module, name)
        if isinstance(k, nn.Linear) and k.out_features % head_dim:
            return Refused(f"{name} has {k.out_features} features, not whole heads of {head_dim}")
    return plan


def single_stream_parts(block: nn.Module) -> tuple[str, str, str] | None:
    """`(attention, mlp, out)` child names of a single-stream block (FLUX.1-style): an attention without `to_out`, a
    Linear `mlp` reading the same input as its `to_q`, and a child `out` reading `cat([attention, mlp])` (its input
    width is theirs summed); None for any other module."""
    children = dict(block.named_children())
    for a, attn in children.items():
        q = query_projection(attn) if is_attention(attn) else None
        if not isinstance(q, nn.Linear) or _child(attn, "to_out") is not None:
            continue
        for m, mlp in children.items():
            if not isinstance(mlp, nn.Linear) or mlp.in_features != q.in_features:
                continue
            for o, out in children.items():
                if o != m and getattr(out, "in_features", None) == q.out_features + mlp.out_features:
                    return a, m, o
    return None


def single_stream_plan(block: nn.Module) -> dict | Refused:
    """A single-stream block's plan: its attention's, the MLP's input colwise, and the projection over
    `cat([attention, mlp])` as a `SplitProjection` (both parts rowwise into partial sums, one all-reduce)."""
    a, m, o = single_stream_parts(block)
    attention = attention_plan(getattr(block, a))
    if isinstance(attention, Refused):
        return attention
    out = getattr(block, o)
    if not isinstance(out, SplitProjection):
        return Refused(f"its `{o}` reads cat([{a}, {m}]) as one {type(out).__name__}; column sharding needs it split "
                       "into a SplitProjection (a `columns` leaf in the family's rewrite, then surgery.unfuse)")
    return {**under(a, attention), m: ColwiseParallel(), **under(o, SPLIT_PROJECTION_TP_PLAN)}


# diffusers' names of a feed-forward written beside its model (`...FeedForward`; `Krea2SwiGLU`, `Ideogram4MLP`)
FEED_FORWARD_NAMES = ("FeedForward", "SwiGLU", "MLP")


def feed_forward_parts(module: nn.Module) -> tuple[tuple[str, ...], str, bool] | None:
    """`(ins, out, gated)` for a feed-forward module other than diffusers' `FeedForward` (planned by its registered
    plan): a class named `...FeedForward` (or `...SwiGLU`, `...MLP`) whose Linears are two, `in` then `out`, with `out` reading `in`'s width
    (plain) or half of it (gated: rows gate and up fused in `in`); or three, gate and up as two Linears of the same
    shape and one reading their width back (SwiGLU written `w2(silu(w1(x)) * w3(x))`); or a plain `nn.Sequential` of
    a Linear, activations and a Linear reading its width (WanAnimate2's `ffn`: no rows to tell apart, nothing fused).
    None for any other module."""
    if type(module) is nn.Sequential:
        return sequential_mlp_parts(module)
    if not any(name in type(module).__name__ for name in FEED_FORWARD_NAMES):
        return None
    linears = [(path, m) for path, m in module.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) == 3:
        found = []
        for i, (last, b) in enumerate(linears):
            ins = [(p, a) for j, (p, a) in enumerate(linears) if j != i]
            if all(a.out_features == b.in_features and a.in_features == b.out_features for _, a in ins):
                found.append((tuple(p for p, _ in ins), last, False))
        # square Linears (hidden size = feed-forward width) leave the output one unknown: no rule, not a guess
        return found[0] if len(found) == 1 else None
    if len(linears) != 2:
        return None
    (first, a), (last, b) = linears
    if b.in_features == a.out_features:
        return (first,), last, False
    if 2 * b.in_features == a.out_features:
        return (first,), last, True
    return None


# the modules a plain MLP may hold between its two Linears: elementwise on each feature, so a rank's share of the
# hidden units maps to the same share
ELEMENTWISE = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)


def sequential_mlp_parts(module: nn.Sequential) -> tuple[tuple[str, ...], str, bool] | None:
    """`((first,), last, False)` for `Sequential(Linear, elementwise activations, Linear)` whose last Linear reads the
    first's width; None for any other Sequential (a modulation's `Sequential(SiLU, Linear)`, ...)."""
    children = list(module.named_children())
    if len(children) < 3 or not all(isinstance(m, ELEMENTWISE) for _, m in children[1:-1]):
        return None
    (first, a), (last, b) = children[0], children[-1]
    if type(a) is nn.Linear and type(b) is nn.Linear and b.in_features == a.out_features:
        return (first,), last, False
    return None


def feed_forward_plan(module: nn.Module) -> dict | Refused:
    ins, last, gated = feed_forward_parts(module)
    if gated:
        return Refused(f"its `{ins[0]}` holds gate and up rows fused ({module.get_submodule(ins[0]).out_features} = "
                       f"2 x {module.get_submodule(last).in_features}); column sharding needs them split (a `rows` "
                       "leaf, SplitRows, in the family's rewrite)")
    return {**{first: ColwiseParallel() for first in ins}, last: RowwiseParallel()}


def per_head_parameters(module: nn.Module) -> tuple[str, ...]:
    """The names of a module's own 1-D parameters with one entry per head of an attention it holds that runs on
    DTensors (`runs_on_dtensors`): its forward meets them with that attention's heads-sharded output."""
    heads = {head_count(child) for child in module.children() if is_attention(child) and runs_on_dtensors(child)}
    return tuple(name for name, param in module.named_parameters(recurse=False)
                 if param.ndim == 1 and param.shape[0] in heads)


def derived(module: nn.Module) -> dict | Refused | None:
    """The derived plan of a module (an attention, a single-stream block, a feed-forward, a module's own per-head
    parameters: a plan of its key `""` alone, beside the derived plans of its children), a refusal, or None where no
    rule is about this module."""
    if is_attention(module):
        return attention_plan(module)
    if single_stream_parts(module) is not None:
        return single_stream_plan(module)
    if feed_forward_parts(module) is not None:
        return feed_forward_plan(module)
    per_head = per_head_parameters(module)
    if per_head:
        return {"": PerHeadParameters(*per_head)}
    return None


def check_derived_heads(module: nn.Module, path: str, world: int, plan: dict | None = None) -> None:
    """Key/value heads (GQA) and query heads must split evenly over the mesh: a cut inside a head is wrong. Both
    counts dividing by the mesh also keeps each query group with its key/value head: contiguous shards of `heads / N`
    and `kv_heads / N` cut both at multiples of `heads / kv_heads` (query head i reads kv head i // that ratio).
    With `plan` (the module's), only the projections it shards: a multi-query attention's key/value stay whole."""
    heads = head_count(module)
    head_dim = query_projection(module).out_features // heads
    for name in (*QUERIES, "add_q_proj", *KEYS):
        linear = _child(module, name)
        if plan is not None and name not in plan:
            continue
        if isinstance(linear, nn.Linear) and (linear.out_features // head_dim) % world:
            count = linear.out_features // head_dim
            kind = "heads" if count == heads else f"key/value heads (grouped-query: {heads} query heads)"
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}.{name}' holds {count} {kind} of {head_dim}, which a mesh of {world} "
                f"cannot split evenly. Use a mesh size that divides {count}: {mesh_sizes_dividing(count)}"
                f"{refusal_hint(world)}.")
