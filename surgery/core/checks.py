"""Checks run before any module is touched: each raises `SurgeryError` naming the module, the number and the fix."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from surgery.core.errors import SurgeryError
from surgery.core.prequantized import prequantized_model
from surgery.core.split_projection import pack_for_inference


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_STATE_DICT_HOOKS = (
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"
)


# The load_state_dict pre-hook `surgery.integration.diffusers_hooks` gives each unfused module (it reads either layout): surgery's
# own, removed and reinstalled by the verbs themselves, so never a reason to refuse; nor is the forward pre-hook that
# packs the leaves for inference (`surgery.core.split_projection.pack_for_inference`), which `fuse` removes.
SURGERY_LOAD_HOOK = "_surgery_load_state_dict_hook"


def _foreign_hooks(module: nn.Module, name: str) -> list:
    hooks = getattr(module, name, None) or {}
    own = getattr(module, SURGERY_LOAD_HOOK, None) if name == "_load_state_dict_pre_hooks" else None
    return [key for key, hook in hooks.items() if (own is None or key != own.id) and hook is not pack_for_inference]


def _hook_kinds(module: nn.Module, torch_hooks: bool) -> list[str]:
    kinds = [name for name in _MODULE_HOOKS + _STATE_DICT_HOOKS if torch_hooks and _foreign_hooks(module, name)]
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None and any(name.startswith("cp_") for name in getattr(registry, "hooks", {})):
        kinds.append("diffusers context-parallel hooks (call surgery.tensor_parallel before surgery.context_parallel, "
                     "on a model without them)")
    elif registry is not None and getattr(registry, "hooks", True):  # an empty registry: left by `cache_context`
        kinds.append("diffusers hooks (offloading, layerwise casting or caching)")
    if getattr(module, "_hf_hook", None) is not None:
        kinds.append("accelerate hooks (device_map or CPU offloading)")
    return kinds


def check_model(model: nn.Module, verb: str) -> None:
    """Model-wide states that no rewrite can carry over."""
    if prequantized_model(model):  # GGUF / fp8r weights slice like their layout allows (surgery.core.prequantized)
        return
    if getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None:
        raise SurgeryError(
            f"surgery.{verb}: '{type(model).__name__}' is quantized; its weights are packed in a quantizer's layout "
            f"that cannot be sliced. Run surgery.{verb} on the unquantized model, then quantize."
        )


def wrapper_kind(module: nn.Module) -> str | None:
    """The data-parallel wrapper `module` is (or has become), if any: DDP, FSDP1, or an FSDP2 `fully_shard` module."""

    if isinstance(module, DistributedDataParallel):
        return "DistributedDataParallel"
    if isinstance(module, FullyShardedDataParallel):
        return "FullyShardedDataParallel (FSDP1)"
    if isinstance(module, FSDPModule) or hasattr(module, "_get_fsdp_state"):
        return "FSDP2 (fully_shard)"
    return None


def wrapper_error(path: str, kind: str, verb: str) -> SurgeryError:
    wrap = "DistributedDataParallel(model)" if kind.startswith("Distributed") else "fully_shard(...) / FSDP(model)"
    return SurgeryError(
        f"surgery.{verb}: '{path}' is wrapped by {kind}, which has registered the parameters surgery.{verb} would "
        f"replace (its gradient hooks and buckets would keep the old ones). Call surgery.{verb} on the unwrapped "
        f"model first, then wrap: `surgery.{verb}(model); model = {wrap}`."
    )


def check_wrappers(model: nn.Module, verb: str) -> None:
    """No DDP / FSDP wrapper on or inside `model` (the outside ones `surgery.core.rewrite` finds through the optimizer
    scan)."""
    for path, module in model.named_modules():
        kind = wrapper_kind(module)
        if kind is not None:
            raise wrapper_error(path or type(model).__name__, kind, verb)


def check_replaced_parameter(param: torch.Tensor, name: str, verb: str, also_at: list[str]) -> None:
    """A Parameter that a rewrite replaces by new ones must carry nothing the new ones would lose."""
    kinds = [
        label
        for attr, label in (("_backward_hooks", "tensor hooks (register_hook)"),
                            ("_post_accumulate_grad_hooks", "post-accumulate-grad hooks"))
        if getattr(param, attr, None)
    ]
    if kinds:
        raise SurgeryError(
            f"surgery.{verb}: '{name}' has {' and '.join(kinds)}, which would stop firing on the parameters that "
            f"replace it. Remove them (handle.remove()) before surgery.{verb} and register them on the new parameters "
            "afterwards."
        )
    if also_at:
        raise SurgeryError(
            f"surgery.{verb}: '{name}' is tied to {also_at[0]!r} (the same Parameter object); surgery.{verb} would "
            f"replace it in one place only and untie them. Untie them first (give '{also_at[0]}' its own copy), or "
            f"run surgery.{verb} where the tie does not cross a rewritten module."
        )
    check_inference_tensor(param, name, verb)


def check_inference_tensor(param: torch.Tensor, name: str, verb: str) -> None:
    # inside inference_mode the new Parameters are inference tensors too, as stock's are when built there
    if param.is_inference() and not torch.is_inference_mode_enabled():
        raise SurgeryError(
            f"surgery.{verb}: '{name}' is an inference tensor: the model was built or loaded under "
            "torch.inference_mode(), and inference tensors cannot be sliced into new Parameters. Build or load it "
            "outside inference_mode (torch.no_grad() is enough), or give it new Parameters first, under "
            "torch.no_grad(): `setattr(module, name, nn.Parameter(p.clone(), p.requires_grad))` for each."
        )


def check_hooks(module: nn.Module, path: str, verb: str, torch_hooks: bool = True) -> None:
    """No hooks that a swapped module would lose (`torch_hooks`), nor offloading/casting hooks that own the weights."""
    kinds = _hook_kinds(module, torch_hooks)
    if kinds:
        raise SurgeryError(
            f"surgery.{verb}: '{path}' ({type(module).__name__}) has {', '.join(kinds)}, which surgery.{verb} cannot "
            f"carry over. Remove them (disable offloading / layerwise casting / caching) before surgery.{verb}, "
            "and enable them again afterwards where they still apply."
        )


def check_linear(module: nn.Module, path: str, verb: str, embedding: bool = False,
                 quantized: Callable[[torch.Tensor], bool] | None = None) -> None:
    """A Linear whose parameters get sliced or concatenated must be a plain, unsharded, unquantized `nn.Linear`
    (`embedding=True`: a plain `nn.Embedding`, which the stock styles shard too); parameters for which `quantized`
    is True are the caller's to check (a verb that knows how to cut that layout)."""
    cls = type(module)
    if hasattr(module, "base_layer") or cls.__module__.startswith("peft"):
        raise SurgeryError(
            f"surgery.{verb}: '{path}' is wrapped by a PEFT/LoRA adapter ({cls.__module__}.{cls.__name__}). Merge and "
            "unload the adapter first (diffusers: `model.fuse_lora(); model.unload_lora()`; peft: "
            f"`merge_and_unload()`), then call surgery.{verb}."
        )
    for name, param in module.named_parameters(recurse=False):
        _check_unsharded(param, f"{path}.{name}", verb)
    if cls is not (nn.Embedding if embedding else nn.Linear):
        what = "a quantized layer" if "quant" in f"{cls.__module__}.{cls.__name__}".lower() else "not a torch.nn.Linear"
        raise SurgeryError(
            f"surgery.{verb}: '{path}' is a {cls.__module__}.{cls.__name__}, {what}. Only plain nn.Linear layers can be "
            f"sliced: run surgery.{verb} before quantizing or replacing layers."
        )
    for name, param in module.named_parameters(recurse=False):
        if quantized is not None and quantized(param):
            continue
        _check_plain(param, f"{path}.{name}", verb)


def check_parameter(param: torch.Tensor, path: str, verb: str) -> None:
    """A parameter a rewrite slices or concatenates that no Linear holds (a MoE's 3-D expert weights) must be a plain,
    unsharded, unquantized floating-point tensor, as a Linear's must."""
    _check_unsharded(param, path, verb)
    _check_plain(param, path, verb)


def _check_unsharded(param: torch.Tensor, path: str, verb: str) -> None:
    if _is_dtensor(param):
        fix = (
            "surgery.tensor_parallel has been applied already: shard a fresh, unsharded model instead."
            if verb == "tensor_parallel"
            else "Call surgery.unfuse on the unsharded model, then surgery.tensor_parallel; to fuse a sharded "
            "model, gather it first (`full_tensor()`) into an unsharded copy."
        )
        raise SurgeryError(
            f"surgery.{verb}: '{path}' is already sharded (a DTensor with placements {tuple(param.placements)}). {fix}"
        )


def _check_plain(param: torch.Tensor, path: str, verb: str) -> None:
    check_inference_tensor(param, path, verb)
    if type(param) not in (nn.Parameter, torch.Tensor) or not param.is_floating_point():
        raise SurgeryError(
            f"surgery.{verb}: '{path}' holds a {type(param).__name__} of dtype {param.dtype}, which looks "
            f"quantized. Run surgery.{verb} on the unquantized model, then quantize."
        )


def mesh_sizes_dividing(n: int, limit: int = 64) -> list[int]:
    """The mesh sizes (up to `limit`) that split `n` evenly: what an error suggests instead."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
