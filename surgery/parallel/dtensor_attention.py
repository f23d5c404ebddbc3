"""Any attention processor, unmodified: the heads as DTensors.

The head-dim twin (`surgery.core.leaves`) covers processors that read the stored head count only to reshape. Others
read it for more (`num_kv_heads` for grouped queries, `out_dim` to reshape back, a full-width gate). DTensor already
knows global shapes, so the stock processor runs as it is once its q/k/v leave their colwise Linears as DTensors
sharded on the last dim (`ColwiseParallel(use_local_output=False)`): `view(b, -1, attn.heads, head_dim)` is then a
shard over heads, attention runs on each rank's heads, the merge back to `out_dim` is a shard on the last dim again,
and the output projection takes it rowwise (`RowwiseParallel()` accepts a DTensor `Shard(-1)` input as it is).

`ImplicitReplication` is the attention module's own style: its remaining parameters (per-head norm weights, scales)
become replicated DTensors, so their gradients are summed over ranks, and plain tensors the processor meets on the
way (rotary tables, masks) are taken as replicated while the module runs, forward and backward
(`torch.distributed.tensor.experimental.implicit_replication`, entered by hooks: wiring, no code in forward).

Nothing here can be silently wrong where DTensor would redistribute: a view or `repeat_interleave` that DTensor
cannot keep sharded gathers instead, which shows as a collective the conformance suite counts. What could be silently
wrong is a rank's local tensor taken as replicated; inside the attention only the output projection returns a local
tensor, and it ends the processor's DTensor flow.

torch 2.13 has no sharding rule for the CPU flash-attention op that `scaled_dot_product_attention` runs on CPU (CUDA's
flash, efficient and cuDNN ops have theirs), so DTensor would gather q/k/v there; `register_cpu_attention_sharding`
gives it the rule the CUDA ops have: batch or heads sharded alike in q, k, v, output and statistics, a mask sharded
where it holds one entry per head or batch and replicated where it broadcasts. Two more completions serve a MoE
layer run so (NucleusMoE's): `scatter_add` of partial sums stays partial (`register_partial_scatter_add`), and an
in-place `scatter_add_` into a plain tensor takes it as replicated (`register_plain_scatter_add_`).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.experimental import implicit_replication, register_sharding
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils._pytree import tree_map_only

_state = threading.local()


def _enter(mesh: DeviceMesh) -> None:
    """Take plain tensors as replicated until `_exit`: in the ops the forward runs (implicit replication), and in
    those its backward runs, which meet the plain tensors the forward saved (the backward of `q * cos` multiplies by
    `cos`): each is saved as a `Replicate` DTensor of the mesh (a view, no copy)."""

    pack = functools.partial(replicated, mesh=mesh)
    contexts = (implicit_replication(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
    for context in contexts:
        context.__enter__()
    _state.stack = [*getattr(_state, "stack", []), contexts]


def _exit() -> None:
    contexts = _state.stack.pop()
    for context in reversed(contexts):
        context.__exit__(None, None, None)
    if _state.stack:  # torch's exit switches implicit replication off, also for an enclosing module still running
        outer = implicit_replication()
        outer.__enter__()
        _state.stack[-1] = (outer, _state.stack[-1][1])


def replicated(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A plain tensor as a `Replicate` DTensor of `mesh` (its gradient, where it needs one, reduced back to a plain
    tensor by `from_local`'s backward); a DTensor as it is."""
    if isinstance(tensor, DTensor):
        return tensor
    return DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)


class ImplicitReplication(ParallelStyle):
    """The style of an attention module whose processor runs on DTensor q/k/v (its Linears colwise with
    `use_local_output=False`, its output projections rowwise): its parameters not yet placed become `Replicate`
    DTensors (their gradients summed over ranks), so do the tensors it is called with (hidden states, rotary tables,
    masks: every rank holds them whole; a gradient they need comes back reduced), and while it runs the plain tensors
    it makes count as replicated, in its forward and in the backward of what its forward computed (`_enter`). No
    collective of its own in forward, except with `sum_output`: a module whose output is the ranks' partial sums (a
    MoE layer: its routed and its shared experts' rowwise down projections, added up) hands it on resolved by one
    all-reduce, as a plain tensor."""

    def __init__(self, sum_output: bool = False):
        super().__init__()
        self.sum_output = sum_output

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        register_cpu_attention_sharding()
        register_partial_scatter_add()
        register_plain_scatter_add_()

        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    placed = DTensor.from_local(param.detach(), mesh, (Replicate(),), run_check=False)
                    mod.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))

        def enter(mod, args, kwargs):
            _enter(mesh)
            return tree_map_only(torch.Tensor, functools.partial(replicated, mesh=mesh), (args, kwargs))

        distribute_module(module, mesh, replicate)
        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(lambda mod, args, out: _exit(), always_call=True)
        if self.sum_output:
            module.register_forward_hook(lambda mod, args, out: tree_map_only(DTensor, _summed, out))
        return module


def _summed(tensor: DTensor) -> torch.Tensor:
    """A module's DTensor output (partial sums) as the plain tensor every rank holds: one all-reduce."""
    return tensor.redistribute(placements=[Replicate()] * tensor.device_mesh.ndim).to_local()


@functools.cache
def register_cpu_attention_sharding() -> None:
    """DTensor's sharding rule for `aten._scaled_dot_product_flash_attention_for_cpu` and its backward, as torch's
    own for the CUDA flash op (see the module docstring)."""
    aten = torch.ops.aten

    def mask_placement(mask, dim: int):
        if mask is None:
            return None
        return Shard(dim) if mask.ndim == 4 and mask.shape[dim] > 1 else Replicate()

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        out = [([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None, mask_placement(attn_mask, d), None])
               for d in (1, 0)]
        whole = None if attn_mask is None else Replicate()
        return [*out, ([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None, whole, None])]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, attn_mask=None,
                 scale=None):
        sharded = [([Shard(d)] * 3, [Shard(d)] * 6 + [None, None, mask_placement(attn_mask, d), None]) for d in (1, 0)]
        whole = None if attn_mask is None else Replicate()
        return [*sharded, ([Replicate()] * 3, [Replicate()] * 6 + [None, None, whole, None])]

    reshard_mask_like_query(aten._scaled_dot_product_flash_attention_for_cpu.default, 0)
    reshard_mask_like_query(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 1)


def reshard_mask_like_query(op, query_index: int) -> None:
    """The CPU attention ops take their mask as a keyword argument, which DTensor never redistributes (its dispatcher
    reshards positional arguments only): a mask with one entry per head (Lumina-Next's, expanded over `attn.heads`)
    would reach the kernel whole beside a rank's share of the heads. A DTensor op handler (its hook for ops its
    sharding rules cannot serve alone) gives the mask the query's placement first (a local slice of a replicated
    mask, as the sharding rule above asks; no collective), then dispatches the op as DTensor does."""
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers

    def handler(op_call, args, kwargs):
        mask, query = kwargs.get("attn_mask"), args[query_index]
        if isinstance(mask, DTensor) and isinstance(query, DTensor) and mask.ndim == 4:
            want = tuple(Shard(p.dim) if isinstance(p, Shard) and mask.shape[p.dim] > 1 else Replicate()
                         for p in query.placements)
            if tuple(mask.placements) != want:
                kwargs = {**kwargs, "attn_mask": mask.redistribute(mask.device_mesh, want)}
        del handlers[op]  # DTensor's own dispatch, for this one call
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op] = handler

    handlers[op] = handler


@functools.cache
def register_partial_scatter_add() -> None:
    """DTensor's sharding rule for `scatter_add`, with the partial sums torch 2.13 lacks (it reduce-scatters both):
    `scatter_add(a, i, s)` is linear in `(a, s)` together, so partial `a` and `s` with a replicated index give partial
    sums of the result (a MoE layer's shared-expert output with its routed outputs scattered in). Otherwise as torch's
    own: all replicated, or sharded alike on a dim other than the scatter dim (where the index spans it whole)."""

    @register_sharding(torch.ops.aten.scatter_add.default)
    def scatter_add(self, dim, index, src):
        dim = dim % self.ndim
        rules = [([Replicate()], [Replicate(), None, Replicate(), Replicate()]),
                 ([Partial()], [Partial(), None, Replicate(), Partial()])]
        for d in range(self.ndim):
            if d != dim and index.shape[d] == self.shape[d] == src.shape[d]:
                rules.append(([Shard(d)], [Shard(d), None, Shard(d), Shard(d)]))
        return rules


@functools.cache
def register_plain_scatter_add_() -> None:
    """`scatter_add_` into a plain tensor with DTensor arguments, while plain tensors count as replicated (NucleusMoE's
    router sums each token's scores into a plain `torch.zeros` in place: `token_score_sums.scatter_add_(0, indices,
    gating)`): DTensor dispatches an in-place op only on a DTensor `self`. A DTensor op handler runs it on `self`
    taken as replicated (its local tensor is `self`: written in place, as the stock code wrote it) and returns
    `self`; a collective only where an argument must be made replicated first."""
    op = torch.ops.aten.scatter_add_.default
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers

    def handler(op_call, args, kwargs):
        self, *rest = args
        if not isinstance(self, DTensor) and dispatcher._allow_implicit_replication:
            mesh = next(a.device_mesh for a in rest if isinstance(a, DTensor))
            placed = DTensor.from_local(self, mesh, [Replicate()] * mesh.ndim, run_check=False)
            args = (placed, *rest)
        del handlers[op]  # DTensor's own dispatch, for this one call
        try:
            op_call(*args, **kwargs)
        finally:
            handlers[op] = handler
        return self

    handlers[op] = handler
