"""`tensor_parallel`: shard an unfused model with stock `parallelize_module`, one call per transformer block.

Each module class that can be sharded has a plan of stock styles registered beside its definition (see
each family's file in `rewrites/`); a caller may pass a literal plan instead. The plan each block gets is assembled
in `surgery.parallel.plans` (`effective_plan` shows it). Nothing here runs in forward: the plans' hooks and DTensor
do all the work.

`tensor_parallel` reads as its five steps, one call each: adopt a pre-quantized model's Linears
(`surgery.parallel.quantized.adopt`, the one change before sharding), plan (`planned_for`, which changes nothing),
check (`check_planned`), agree across ranks (`agree`), shard block by block (`shard_blocks`). Quantized weights
go through `surgery.parallel.quantized` alone (`place_parameter`, `parts`): the sharding code here does not branch
on them.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from surgery.core import heads_padding
from surgery.core.errors import SurgeryError
from surgery.core.split_projection import CALL, SplitProjection, SplitRows, pack
from surgery.parallel import quantized as quant
from surgery.parallel.agreement import agree, fingerprint
from surgery.parallel.distributed import one_dim_mesh
from surgery.parallel.padding import head_paddings
from surgery.parallel.plans import (
    FilterFn, Planned, block_path, block_plans, check_planned, linear_placements, plan_digest, planned_for,
)


def shard_on_host(module: nn.Module, plan: dict, mesh: DeviceMesh, src_data_rank: int | None) -> list:
    """Place the planned Linears' parameters that are not on the mesh's device as DTensors, moving only shards.

    torch's `distribute_tensor` would first move each whole weight to the device; here each rank slices its shard
    where the weight is and moves just that (`surgery.parallel.quantized.place_parameter`). The stock styles then
    find their parameters already placed. What replaces a parameter only after the styles ran (a quantized weight in
    torchao's sharded layout) is returned as (Linear, name, Parameter) for `apply_block` to put in.
    """
    aside = []
    for key, style in plan.items():
        linear = module.get_submodule(key)
        placements = linear_placements(style, linear)
        if placements is None:
            continue
        for name, param in list(linear.named_parameters(recurse=False)):
            now, after = quant.place_parameter(param, placements[name][0], mesh, src_data_rank, f"{key}.{name}")
            if now is not None:
                setattr(linear, name, now)
            if after is not None:
                aside.append((linear, name, after))
    return aside


def broadcast_replicated(model: nn.Module, mesh: DeviceMesh, src_data_rank: int) -> None:
    """Give every parameter and buffer held whole on each rank the values rank `src_data_rank` holds.

    Covers plain tensors and replicated DTensors alike (`SequenceParallel` replicates norm weights with `from_local`,
    which trusts every rank's copy), and the whole inner tensors of a quantized weight (a per-row scale under a
    rowwise cut).
    """
    group = mesh.get_group()
    src = dist.get_global_rank(group, src_data_rank)
    with torch.no_grad():
        for tensor in [part for t in [*model.parameters(), *model.buffers()] for part in quant.parts(t)]:
            if isinstance(tensor, DTensor):
                if not all(p.is_replicate() for p in tensor.placements):
                    continue
                tensor = tensor.to_local()
            if tensor.is_meta:
                continue
            data = tensor.detach()
            if data.dtype.itemsize == 1 and data.is_floating_point():  # gloo sends no float8: send its bytes
                data = data.view(torch.uint8)
            on_mesh = data if data.device.type == mesh.device_type else data.to(mesh.device_type)
            # a broadcast sends and fills memory in order: ranks whose copies are laid out differently (one stored
            # transposed) must meet in a dense buffer
            on_mesh = on_mesh.contiguous()
            dist.broadcast(on_mesh, src=src, group=group)
            if on_mesh is not data:
                data.copy_(on_mesh)


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle] | None = None,
                    filter_fn: FilterFn | None = None, *, src_data_rank: int | None = 0,
                    pad_heads: bool = False) -> nn.Module:
    """Shard an unfused model over a 1-D `mesh` with stock `parallelize_module`; in place, returns `model`.

    By default every module with a registered plan is sharded, each block with the plan
    `surgery.parallel.plans.effective_plan(model)` shows. `plan` replaces them with a literal
    `{module path: stock style}` (`"transformer_blocks.*.attn.to_q": ColwiseParallel()`, `*` standing for one name
    as in `parallelize_module`), checked like the registered ones: a key that matches no module, or a module that two
    keys match, is refused, and the heads and sizes of what it shards must split over the mesh. `filter_fn(module,
    fqn)` (torchao's `quantize_` signature) keeps only the planned modules it returns True for; the others stay
    whole on every rank. Keep or drop a block's entries together: a block half sharded computes with mismatched
    shapes.

    Every check runs first, on every rank, and the ranks agree before the first collective
    (`surgery.parallel.agreement`): a refusal on any rank, or ranks holding different models (class, config, shapes,
    dtypes; with `src_data_rank=None` the weights too) or given different plans, raises the same `SurgeryError` on
    every rank and leaves the model untouched. `src_data_rank` (a rank of `mesh`) is the rank whose weights every
    rank ends up with, as in `parallelize_module`; `None` lets each rank slice its own identical copy (loaded from one
    checkpoint) with no collective at all. Weights may sit on another device than the mesh (CPU weights, a cuda or
    neuron mesh): only shards are moved. Call `model.to(device)` afterwards to move the replicated rest.

    Sharding then runs block by block, each block in two steps. First every rank shards the block's own weights,
    which needs no collective, and the ranks exchange their verdicts (one small `all_gather_object`); for an integer
    `src_data_rank`, that rank then sends its shards of the block (scatter or broadcast per parameter: only the
    transfer itself runs there). Then the block's unsharded Parameters are released (their storage freed; the objects
    are kept), so a rank's peak is the model plus one block's shards, not the model plus all its shards.

    A failure while sharding (out of memory, an interrupt) on any rank makes every rank raise the same error and put
    its model back: the failing block and every block not reached get their very same Parameters and hooks back; the
    blocks already done get their very same Parameter objects back too, refilled from their shards (an all-gather:
    the values each rank held, since with `src_data_rank=None` the ranks agreed they hold the same weights; with an
    integer `src_data_rank`, the source rank's weights, which every rank had already received). Unfused row slices
    that were views of one fused storage come back as separate tensors of the same values.

    An attention whose heads the mesh does not divide is refused, unless `pad_heads=True`: then it gets zero heads up
    to a multiple of the mesh (zero q/k/v rows and output columns, after the real heads; `surgery.core.heads_padding`),
    which leave its output and gradients unchanged and cost each rank what `surgery plan` shows. Saving, adapters
    and `fuse` give back the unpadded model and files.
    """
    mesh = one_dim_mesh(mesh, "tensor_parallel")
    world = mesh.size()
    adopted: list = []
    padded: list = []

    def on_this_rank() -> Planned:  # steps 1-3, no collective: `agree` shares the outcome
        adopted.extend(quant.adopt(model))  # 1. GGUF / fp8r Linears as nn.Linears: the one change before sharding
        planned = planned_for(model, plan, filter_fn)  # 2. the plan (changes nothing)
        if pad_heads:  # zero heads where the mesh does not divide them, all found and checked before any is added
            for p in head_paddings(model, planned, world, lambda path: block_path(model, path)[0]):
                heads_padding.pad(model.get_submodule(p.block), [p.padding])
                padded.append(p)  # undone below if anything after it refuses, here or on another rank
        check_planned(model, planned, world, plan, filter_fn)  # 3. every check
        check_source(model, src_data_rank, world)
        return planned

    def fingerprint_of(planned: Planned) -> dict[str, dict]:
        parts = fingerprint(model, world, src_data_rank, weights=src_data_rank is None)
        if plan is not None or filter_fn is not None:  # ranks given different plans would shard differently
            parts["call"]["plan"] = plan_digest(planned)
        return parts

    try:
        # 4. the ranks agree: every rank raises the same error, putting its model back, or none does
        planned = agree(mesh, "tensor_parallel", on_this_rank, fingerprint_of, reference=src_data_rank or 0)
        # 5. shard block by block; a failure anywhere puts every rank's model back
        shard_blocks(model, planned, mesh, src_data_rank)
    except BaseException:
        unpad(model, padded)
        quant.unadopt(adopted)
        raise
    if src_data_rank is not None:
        broadcast_replicated(model, mesh, src_data_rank)
    pack_sharded(model, planned, mesh)
    return model


def shard_blocks(model: nn.Module, planned: Planned, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """`shard_block` for every block, in order; a failure on any rank puts every rank's blocks back and raises."""
    done: list[ModuleStates] = []
    for path, block_plan in block_plans(model, planned).items():
        done.append(shard_block(model, path, block_plan, mesh, src_data_rank, done))


def unpad(model: nn.Module, padded: list) -> None:
    """Undo the zero heads `tensor_parallel` added (the blocks put back whole first), the real values bitwise."""
    for p in reversed(padded):
        block = model.get_submodule(p.block)
        heads_padding.unpad_one(block, p.padding)


def shard_block(model: nn.Module, path: str, block_plan: dict, mesh: DeviceMesh, src_data_rank: int | None,
                done: list["ModuleStates"]) -> "ModuleStates":
    """Shard one block on every rank, then agree on the outcome; on any rank's failure every rank restores this
    block and refills the blocks in `done`, and raises the same error."""
    own = block_plan.pop("", None)
    block = model.get_submodule(path)
    saved = ModuleStates(block)
    error: BaseException | None = None
    try:
        apply_block(block, block_plan, own, mesh, src_data_rank=None)
    except BaseException as caught:  # noqa: BLE001 - every rank hears of it below, then it is raised
        saved.restore()
        error = caught
    # No collective ran while sharding this block, so every rank reaches this exchange, whatever happened on the others.
    try:
        agree(mesh, "tensor_parallel", lambda: _raise(error),
              during=f"while sharding '{path or '<model>'}', and every rank put its model back as it was",
              handshake=False)
    except BaseException:
        if error is None:
            saved.restore()
        for states in reversed(done):
            states.refill()
        raise
    if src_data_rank is not None:
        copy_from_source(block, saved.originals(), mesh, src_data_rank)
    saved.release()
    return saved


def apply_block(block: nn.Module, plan: dict, own: ParallelStyle | None, mesh: DeviceMesh,
                src_data_rank: int | None) -> None:
    """One stock `parallelize_module` call for a block's plan (plus one for the block's own style); parameters
    already placed as DTensors, by `shard_on_host` or a sharded load, pass through the stock styles untouched."""
    aside = shard_on_host(block, plan, mesh, src_data_rank)
    parallelize_module(block, mesh, plan, src_data_rank=src_data_rank)
    if own is not None:
        parallelize_module(block, mesh, own, src_data_rank=src_data_rank)
    for linear, name, param in aside:
        linear.register_parameter(name, param)


def apply_plans(model: nn.Module, planned: Planned, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """`apply_block` for every block of `model`."""
    for path, plan in block_plans(model, planned).items():
        own = plan.pop("", None)
        apply_block(model.get_submodule(path), plan, own, mesh, src_data_rank)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def check_source(model: nn.Module, src_data_rank: int | None, world: int) -> None:
    """`src_data_rank` names a rank of the mesh, and every rank holds real weights to send or receive into."""
    if src_data_rank is None:
        return
    if not isinstance(src_data_rank, int) or not 0 <= src_data_rank < world:
        raise SurgeryError(
            f"surgery.tensor_parallel: src_data_rank={src_data_rank!r} is not a rank of the mesh of {world}. Pass a "
            f"rank from 0 to {world - 1}, or None to let each rank keep its own weights."
        )
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise SurgeryError(
                f"surgery.tensor_parallel: {name!r} is on the meta device; with src_data_rank={src_data_rank} every "
                f"rank needs real weights (rank {src_data_rank} sends its own, the others receive into theirs). Load "
                "the weights first (or use surgery.load_tensor_parallel), or pass src_data_rank=None where every "
                "rank holds meta weights on purpose."
            )


class ModuleStates:
    """What `parallelize_module` changes on each module (parameters, buffers, hooks, the attributes it sets),
    recorded before sharding so that a failure puts the very same objects back."""

    _DICTS = (
        "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks",
    )

    def __init__(self, model: nn.Module):
        self.saved = [
            (module, {name: dict(getattr(module, name)) for name in self._DICTS if hasattr(module, name)},
             set(vars(module)))
            for module in model.modules()
        ]

    def restore(self) -> None:
        for module, dicts, keys in self.saved:
            for name, saved in dicts.items():
                live = getattr(module, name)
                live.clear()
                live.update(saved)
            for key in set(vars(module)) - keys:  # e.g. `_distribute_module_applied`
                del module.__dict__[key]

    def release(self) -> None:
        """Free the storage of every Parameter that sharding replaced, keeping the objects (and what they were) so
        that `refill` can give them their values back."""
        self.released = []
        for module, dicts, _ in self.saved:
            for name, original in dicts["_parameters"].items():
                if original is None or module._parameters.get(name) is original:
                    continue
                held = [(part, part.shape) for part in quant.parts(original)]
                self.released.append((module, name, held))
                for part, _ in held:
                    part.data = torch.empty(0, dtype=part.dtype, device=part.device)

    def refill(self) -> None:
        """Put back the released Parameter objects, refilled with the whole values of the shards that replaced
        them (an all-gather per sharded tensor, in the same order on every rank), then the modules' state."""
        with torch.no_grad():
            for module, name, held in getattr(self, "released", []):
                for (original, shape), current in zip(held, quant.parts(module._parameters[name])):
                    if original.is_meta or current.is_meta:
                        original.data = torch.empty(shape, dtype=original.dtype, device="meta")
                        continue
                    whole = current.full_tensor() if isinstance(current, DTensor) else current
                    original.data = whole.detach().to(original.device).clone()
        self.restore()

    def originals(self) -> dict[tuple[int, str], torch.Tensor]:
        """(id(module), parameter name) -> the Parameter it held before sharding."""
        return {(id(module), name): p for module, dicts, _ in self.saved for name, p in dicts["_parameters"].items()}


def copy_from_source(model: nn.Module, originals: dict, mesh: DeviceMesh, src_data_rank: int) -> None:
    """Give every rank rank `src_data_rank`'s shard of each sharded parameter, cut from its unsharded original.

    A scatter per parameter where the originals sit on the mesh's device (as torch's `distribute_tensor` does); one
    broadcast per shard where they sit elsewhere, so that only one shard at a time is moved to the device. The
    ranks agreed on where their weights sit (the fingerprint), so they all take the same branch. A quantized
    weight's sharded inner tensors (values, per-row scales) are sent the same way, each cut from its original.
    """
    src = dist.get_global_rank(mesh.get_group(), src_data_rank)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module._parameters.items():
                original = originals.get((id(module), name))
                if original is None or original is param:
                    # sharded before this block was (a root plan over blocks that were sharded on their own):
                    # its values came from the source rank then. Every rank skips it alike.
                    continue
                for sharded, whole in zip(quant.parts(param), quant.parts(original)):
                    if isinstance(sharded, DTensor) and sharded.placements[0].is_shard():
                        copy_shard(sharded, whole.detach(), mesh, src, src_data_rank)


def copy_shard(param: DTensor, original: torch.Tensor, mesh: DeviceMesh, src: int, src_data_rank: int) -> None:
    """Rank `src_data_rank`'s cut of `original` into this rank's shard of `param` (see `copy_from_source`)."""
    group = mesh.get_group()
    me, world = mesh.get_local_rank(), mesh.size()
    shard = param._local_tensor
    # A collective fills its output's memory in order, whatever the strides: a shard of a weight stored transposed
    # (`w.t().contiguous().t()`, kept as a strided view by `src_data_rank=None` slicing) receives into a dense buffer.
    local = shard if shard.is_contiguous() else torch.empty(shard.shape, dtype=shard.dtype, device=shard.device)
    pieces = original.chunk(world, param.placements[0].dim) if me == src_data_rank else None
    if local.dtype.itemsize == 1 and local.is_floating_point():  # gloo sends no float8: send its bytes
        local = local.view(torch.uint8)
        pieces = [p.contiguous().view(torch.uint8) for p in pieces] if pieces is not None else None
    if original.device.type == mesh.device_type:
        scatter = [p.contiguous() for p in pieces] if pieces is not None else None
        dist.scatter(local, scatter, src=src, group=group)
    else:
        for i in range(world):
            if i == src_data_rank:
                continue
            buffer = pieces[i].to(local.device).contiguous() if pieces is not None else torch.empty_like(local)
            dist.broadcast(buffer, src=src, group=group)
            if i == me:
                local.copy_(buffer)
    if local.data_ptr() != shard.data_ptr():
        shard.copy_(local.view(shard.dtype))


def pack_sharded(model: nn.Module, planned: Planned, mesh: DeviceMesh) -> int:
    """Lay each sharded `SplitRows`' local shards out back to back in one buffer (the parts' local tensors become views of
    it) and give the leaf a `Packed` that runs its parts' style once over it: per rank, the GEMM of diffusers' packed
    styles. A `SplitProjection` keeps what its packed weight is multiplied with, for the first forward run for
    inference to lay out its columns (`surgery.core.split_projection.pack_for_inference`: FSDP2 takes no
    non-contiguous parameters). Only leaves whose parts all got the same stock linear style, one that takes its input
    as it comes (`input_layouts == desired_input_layouts`), are packed; the rest run their parts' own forwards. The
    number of `SplitRows` packed."""
    styles: dict[str, ParallelStyle] = {}
    for block, plan in block_plans(model, planned).items():
        for key, style in plan.items():
            if key:
                styles[".".join(p for p in (block, key) if p)] = style
    patterns = [(key.split("."), style) for key, style in styles.items()]

    def style_of(path: str) -> ParallelStyle | None:
        if path in styles:
            return styles[path]
        names = path.split(".")
        found = [s for atoms, s in patterns
                 if len(atoms) == len(names) and all(fnmatchcase(n, a) for n, a in zip(names, atoms))]
        return found[0] if len(found) == 1 else None

    packed = 0
    for path, leaf in model.named_modules():
        if not isinstance(leaf, (SplitRows, SplitProjection)):
            continue
        leaf.__dict__.pop(CALL, None)
        names = [name for name, _ in leaf.named_children()]
        found = [style_of(".".join(p for p in (path, name) if p)) for name in names]
        call = _style_call(found, mesh)
        if call is None or not all(isinstance(p, DTensor) for p in leaf.parameters()):
            continue
        leaf.__dict__[CALL] = call
        if isinstance(leaf, SplitRows):
            packed += pack(leaf, call=call)
    return packed


def _style_call(styles: list, mesh: DeviceMesh):
    """What the one stock style of all `styles` does around a Linear, as `call(x, weight, bias)` over a packed
    weight; `None` where the parts' styles differ or the style redistributes its input."""
    first = styles[0]
    if type(first) not in (ColwiseParallel, RowwiseParallel):
        return None
    key = lambda s: (type(s), tuple(s.input_layouts), tuple(s.output_layouts), s.use_local_output)
    if any(s is None or key(s) != key(first) for s in styles):
        return None
    # what each style wants its Linear's input as (RowwiseParallel sets it when applied, by the module's type)
    desired = (Replicate(),) if isinstance(first, ColwiseParallel) else (Shard(-1),)
    if tuple(first.input_layouts) != desired:
        return None
    inputs, outputs, to_local = tuple(first.input_layouts), tuple(first.output_layouts), first.use_local_output

    def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # as the style's input and output hooks do for each part (torch.distributed.tensor.parallel.style)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, inputs, run_check=False)
        elif tuple(x.placements) != inputs:
            x = x.redistribute(placements=inputs)
        y = F.linear(x, weight, bias)
        if tuple(y.placements) != outputs:
            y = y.redistribute(placements=outputs)
        return y.to_local() if to_local else y

    return call
