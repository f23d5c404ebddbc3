"""`context_parallel`: split the sequence over a mesh with diffusers' own context parallelism, beside TP or alone.

diffusers already has everything: `ContextParallelConfig` (Ulysses all-to-all, ring attention), each model's
`_cp_plan` (which inputs to split, which output to gather), `apply_context_parallel` (the split/gather hooks) and
attention processors that take a `_parallel_config`. Its entry point, `ModelMixin.enable_parallelism`, cannot be used
here: it builds its own mesh from the accelerator count (no CPU mesh, no sub-mesh of a `("cp", "tp")` mesh) and its
`ParallelConfig` refuses context and tensor parallelism together. This module is the thin replacement: validate,
build the `("ring", "ulysses")` mesh diffusers expects by unflattening the given 1-D mesh, then call diffusers.

    mesh = init_device_mesh("cuda", (cp, tp), mesh_dim_names=("cp", "tp"))
    surgery.tensor_parallel(surgery.unfuse(model), mesh["tp"])
    surgery.context_parallel(model, mesh["cp"])          # Ulysses over all of mesh["cp"]
    out = model(**inputs, return_dict=False)[0]           # diffusers' split hook needs return_dict=False

Order: tensor parallelism first. Ulysses splits the heads each TP rank holds, so its check needs the sharded model;
`surgery.tensor_parallel` refuses a model that already has context-parallel hooks.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from diffusers.hooks import HookRegistry
from diffusers.hooks import ModelHook
from diffusers.hooks.context_parallel import _get_submodule_by_name
from diffusers.hooks.context_parallel import apply_context_parallel
from diffusers.models._modeling_parallel import ContextParallelConfig
from diffusers.models._modeling_parallel import ParallelConfig
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from diffusers.models.attention_processor import Attention
from diffusers.models.attention_processor import MochiAttention

from surgery.core.checks import mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.parallel.agreement import agree
from surgery.parallel.distributed import one_dim_mesh

# Backends whose context-parallel forward cannot return the log-sum-exp that ring attention merges partial results
# with (diffusers' `_native_attention_forward_op` raises on `return_lse=True`). Every backend that can return it
# (flash, flash hub, _native_cudnn, _native_flash, _native_npu, sage) runs on cuda or npu only.
_NO_LSE_BACKENDS = {"native"}
_GUARD = "surgery_context_parallel_guard"


def _cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    mesh = one_dim_mesh(mesh, "context_parallel", "cp")
    if not mesh.mesh_dim_names:
        # diffusers' ring/ulysses mesh is unflattened from this one, which torch only does for a named dimension
        raise SurgeryError(
            "surgery.context_parallel: the mesh has no dimension name; build it with one, e.g. "
            f"init_device_mesh('{mesh.device_type}', ({mesh.size()},), mesh_dim_names=('cp',)), or pass mesh['cp'] "
            "of a named 2-D mesh."
        )
    return mesh


def _degrees(size: int, ulysses_degree: int | None, ring_degree: int | None) -> tuple[int, int]:
    ring = 1 if ring_degree is None else ring_degree
    ulysses = size // max(ring, 1) if ulysses_degree is None else ulysses_degree
    if ring < 1 or ulysses < 1 or ring * ulysses != size:
        raise SurgeryError(
            f"surgery.context_parallel: ulysses_degree ({ulysses}) x ring_degree ({ring}) must equal the mesh size "
            f"({size}). Pairs that fit: {[(size // r, r) for r in mesh_sizes_dividing(size)]} as (ulysses, ring)."
        )
    if size == 1:
        raise SurgeryError("surgery.context_parallel: the mesh has 1 rank; there is no sequence to split. "
                           "Use a mesh of 2 or more ranks, or leave context parallelism off.")
    return ulysses, ring


def attention_processors(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """`(path, attention module, processor)` for each attention whose processor takes a `_parallel_config`,
    the same walk as diffusers' `enable_parallelism`."""

    found = []
    for path, module in model.named_modules():
        if isinstance(module, (Attention, MochiAttention, AttentionModuleMixin)):
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                found.append((path, module, processor))
    return found


def _backend(processor) -> str:
    backend = getattr(processor, "_attention_backend", None)
    if backend is None:
        backend, _ = _AttentionBackendRegistry.get_active_backend()
    return AttentionBackendName(backend).value


def _tp_mesh(module: nn.Module) -> DeviceMesh | None:
    """The mesh `module`'s sharded parameters (tensor parallelism) sit on, if any."""
    for param in module.parameters():
        if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):
            return param.device_mesh
    return None


def _ranks(mesh: DeviceMesh) -> set[int]:
    return set(mesh.mesh.flatten().tolist())


def validate(model: nn.Module, mesh: DeviceMesh, ulysses: int, ring: int, plan: dict | None) -> dict:
    """Every check `context_parallel` makes, before anything changes; returns the context-parallel plan."""

    name = type(model).__name__
    plan = plan if plan is not None else getattr(model, "_cp_plan", None)
    if not plan:
        raise SurgeryError(
            f"surgery.context_parallel: '{name}' has no `_cp_plan` (diffusers' list of the inputs to split and the "
            "output to gather); pass plan={...} with ContextParallelInput/ContextParallelOutput entries."
        )
    if getattr(model, "_parallel_config", None) is not None or _guarded(model):
        raise SurgeryError(
            f"surgery.context_parallel: '{name}' already runs with a diffusers parallel config (context "
            "parallelism or enable_parallelism applied already). Apply it once, to a fresh model."
        )
    for key in plan:
        try:
            _get_submodule_by_name(model, key)
        except ValueError as error:
            raise SurgeryError(f"surgery.context_parallel: the plan names '{key}', which '{name}' lacks: {error}")

    processors = attention_processors(model)
    if not processors:
        raise SurgeryError(
            f"surgery.context_parallel: '{name}' has no attention processor that takes a parallel config "
            "(`_parallel_config`); its attention would only see each rank's part of the sequence."
        )
    for path, module, processor in processors:
        _check_attention(path, module, processor, mesh, ulysses, ring)
    return plan


def _check_attention(path: str, module: nn.Module, processor, mesh: DeviceMesh, ulysses: int, ring: int) -> None:
    """One attention module: its backend has a context-parallel form, and its heads (per TP rank) split over Ulysses."""
    backend = _backend(processor)
    if backend not in _AttentionBackendRegistry._supports_context_parallel:
        supported = sorted(_AttentionBackendRegistry._supports_context_parallel)
        raise SurgeryError(
            f"surgery.context_parallel: '{path}' ({type(processor).__name__}) uses the attention backend "
            f"'{backend}', which has no context-parallel form. Set one of {supported} with "
            "model.set_attention_backend(...) first."
        )
    if ring > 1 and (backend in _NO_LSE_BACKENDS or mesh.device_type == "cpu"):
        raise SurgeryError(
            f"surgery.context_parallel: ring_degree={ring} needs an attention backend that returns the "
            f"log-sum-exp, and '{path}' uses '{backend}' on a {mesh.device_type} mesh, which does not (none of "
            "diffusers' runs on CPU). Use ulysses_degree only (ring_degree=1), or a cuda mesh with "
            "model.set_attention_backend('flash' / '_native_cudnn' / '_native_flash')."
        )
    tp_mesh = _tp_mesh(module)
    tp = tp_mesh.size() if tp_mesh is not None else 1
    if tp_mesh is not None and _ranks(tp_mesh) & _ranks(mesh) != {dist.get_rank()}:
        raise SurgeryError(
            f"surgery.context_parallel: the context-parallel mesh {mesh.mesh.tolist()} shares ranks with the "
            f"tensor-parallel mesh {tp_mesh.mesh.tolist()} of '{path}'. Pass the other dimension of the 2-D "
            "mesh: mesh['cp'] beside mesh['tp']."
        )
    heads = getattr(module, "heads", None)
    if ulysses > 1 and isinstance(heads, int):
        local = heads // tp
        if heads % tp or local % ulysses:
            raise SurgeryError(
                f"surgery.context_parallel: '{path}' holds {heads} heads / TP {tp} = {heads / tp:g} heads per "
                f"tensor-parallel rank, which ulysses_degree={ulysses} cannot split evenly. Use a ulysses_degree "
                f"dividing {local}: {mesh_sizes_dividing(local)} (the rest as ring_degree on cuda), or a smaller "
                "tensor-parallel size."
            )


def _guarded(model: nn.Module) -> bool:
    registry = getattr(model, "_diffusers_hook", None)
    return registry is not None and any(name.startswith(("cp_", _GUARD)) for name in registry.hooks)


def _check_call(module: nn.Module, signature: inspect.Signature, split: dict, args: tuple, kwargs: dict,
                size: int = 1) -> None:
    """Refuse, at call time, what diffusers' context parallelism would get silently wrong or fail on obscurely."""
    bound = signature.bind_partial(module, *args, **kwargs).arguments
    for name, how in split.items():
        value = bound.get(name)
        expected = getattr(how, "expected_dims", None)
        if isinstance(value, torch.Tensor) and expected is not None and value.dim() != expected:
            # diffusers would only warn and leave it whole, and the forward then fails on mismatched lengths
            raise SurgeryError(
                f"surgery.context_parallel: '{name}' has {value.dim()} dimensions {tuple(value.shape)}; the model's "
                f"context-parallel plan splits it along dim {how.split_dim} only when it has {expected}. Pass it "
                f"with {expected} dimensions (e.g. {name}.unsqueeze(0) for a leading batch dimension)."
            )
        dim = getattr(how, "split_dim", None)
        if isinstance(value, torch.Tensor) and dim is not None and value.dim() > dim and value.shape[dim] % size:
            # diffusers' split hook asserts this with no message
            length = value.shape[dim]
            raise SurgeryError(
                f"surgery.context_parallel: '{name}' has {length} tokens along dim {dim}, which the {size} "
                f"context-parallel ranks cannot split evenly. Use a sequence length divisible by {size} (e.g. "
                f"{length + (-length) % size}: another image size or prompt padding), or fewer context-parallel ranks."
            )
    cached = sorted(k for k, v in bound.items() if k.startswith("kv_cache") and v is not None)
    if cached:
        # The KV-cache attention helpers take no parallel config: with the sequence split, each rank's reference
        # tokens would only attend to its own part (and the cache would hold one rank's part of them).
        raise SurgeryError(
            f"surgery.context_parallel: '{type(module).__name__}' was called with {cached}; KV-cache modes attend "
            "without the context-parallel config, so their results would be wrong with the sequence split. Run "
            "KV-cache passes on a model without context parallelism (tensor parallelism alone supports them)."
        )
    if "return_dict" in signature.parameters and bound.get("return_dict", True):
        raise SurgeryError(
            f"surgery.context_parallel: call '{type(module).__name__}' with return_dict=False; diffusers' "
            "context-parallel split hook accepts only tensors or tuples of tensors as the model's output."
        )


def _guard_hook(model: nn.Module, plan: dict, size: int):
    """A diffusers hook that runs `_check_call` before each forward of `model`."""

    signature = inspect.signature(type(model).forward)
    split = plan.get("", {}) if isinstance(plan.get(""), dict) else {}

    class ContextParallelGuard(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            _check_call(module, signature, split, args, kwargs, size)
            return args, kwargs

    return ContextParallelGuard()


def context_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    plan: dict | None = None,
    convert_to_fp32: bool = True,
) -> nn.Module:
    """Split `model`'s sequence over the 1-D `mesh` with diffusers' context parallelism; in place, returns `model`.

    `ulysses_degree` x `ring_degree` must equal `mesh.size()` (default: Ulysses over the whole mesh). `plan` defaults
    to the model's `_cp_plan`. Works on a plain model or one sharded by `surgery.tensor_parallel` over another
    dimension of the same mesh (call that first); Ulysses then splits the heads each TP rank holds. Every check runs
    first: a raised `SurgeryError` leaves the model untouched. Call the model with `return_dict=False`.
    """


    def check():
        cp_mesh = _cp_mesh(mesh)
        ulysses, ring = _degrees(cp_mesh.size(), ulysses_degree, ring_degree)
        return cp_mesh, ulysses, ring, validate(model, cp_mesh, ulysses, ring, plan)

    # Every rank of the job (not only this CP group) learns every rank's verdict before the first collective: the
    # group creation below involves them all, and a rank that refused alone would leave the others waiting in it.
    mesh, ulysses, ring, plan = agree(None, "context_parallel", check)

    # diffusers' config wants a ("ring", "ulysses") mesh; unflattening the given one keeps its ranks and groups.
    grid = mesh._unflatten(0, (ring, ulysses), ("ring", "ulysses"))
    cp_config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=grid,
                                      convert_to_fp32=convert_to_fp32)
    config = ParallelConfig(context_parallel_config=cp_config)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device(mesh.device_type), mesh=grid)

    for _, _, processor in attention_processors(model):
        processor._parallel_config = config
    apply_context_parallel(model, cp_config, plan)
    registry = HookRegistry.check_if_exists_or_initialize(model)
    registry.register_hook(_guard_hook(model, plan, mesh.size()), _GUARD)  # registered last, so it runs before the split hook
    model._parallel_config = config
    return model
