"""Checks run before any module is touched: each raises `SurgeryError` naming the module, the number and the fix."""

from __future__ import annotations

import torch
import torch.nn as nn


class SurgeryError(ValueError):
    """Bad input for a surgery verb. Raised before anything changes, so the model is as it was."""


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _hook_kinds(module: nn.Module, torch_hooks: bool) -> list[str]:
    kinds = [
        name
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
        if torch_hooks and getattr(module, name, None)
    ]
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None and any(name.startswith("cp_") for name in getattr(registry, "hooks", {})):
        kinds.append("diffusers context-parallel hooks (call surgery.tensor_parallel before surgery.context_parallel, "
                     "on a model without them)")
    elif registry is not None:
        kinds.append("diffusers hooks (offloading, layerwise casting or caching)")
    if getattr(module, "_hf_hook", None) is not None:
        kinds.append("accelerate hooks (device_map or CPU offloading)")
    return kinds


def check_model(model: nn.Module, verb: str) -> None:
    """Model-wide states that no rewrite can carry over."""
    if getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None:
        raise SurgeryError(
            f"surgery.{verb}: '{type(model).__name__}' is quantized; its weights are packed in a quantizer's layout "
            f"that cannot be sliced. Run surgery.{verb} on the unquantized model, then quantize."
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


def check_linear(module: nn.Module, path: str, verb: str) -> None:
    """A Linear whose parameters get sliced or concatenated must be a plain, unsharded, unquantized `nn.Linear`."""
    cls = type(module)
    if hasattr(module, "base_layer") or cls.__module__.startswith("peft"):
        raise SurgeryError(
            f"surgery.{verb}: '{path}' is wrapped by a PEFT/LoRA adapter ({cls.__module__}.{cls.__name__}). Merge and "
            "unload the adapter first (diffusers: `model.fuse_lora(); model.unload_lora()`; peft: "
            f"`merge_and_unload()`), then call surgery.{verb}."
        )
    for name, param in module.named_parameters(recurse=False):
        if _is_dtensor(param):
            fix = (
                "surgery.tensor_parallel has been applied already: shard a fresh, unsharded model instead."
                if verb == "tensor_parallel"
                else "Call surgery.unfuse on the unsharded model, then surgery.tensor_parallel; to fuse a sharded "
                "model, gather it first (`full_tensor()`) into an unsharded copy."
            )
            raise SurgeryError(
                f"surgery.{verb}: '{path}.{name}' is already sharded (a DTensor with placements "
                f"{tuple(param.placements)}). {fix}"
            )
    if cls is not nn.Linear:
        what = "a quantized layer" if "quant" in f"{cls.__module__}.{cls.__name__}".lower() else "not a torch.nn.Linear"
        raise SurgeryError(
            f"surgery.{verb}: '{path}' is a {cls.__module__}.{cls.__name__}, {what}. Only plain nn.Linear layers can be "
            f"sliced: run surgery.{verb} before quantizing or replacing layers."
        )
    for name, param in module.named_parameters(recurse=False):
        if type(param) not in (nn.Parameter, torch.Tensor) or not param.is_floating_point():
            raise SurgeryError(
                f"surgery.{verb}: '{path}.{name}' holds a {type(param).__name__} of dtype {param.dtype}, which looks "
                f"quantized. Run surgery.{verb} on the unquantized model, then quantize."
            )


def mesh_sizes_dividing(n: int, limit: int = 64) -> list[int]:
    """The mesh sizes (up to `limit`) that split `n` evenly: what an error suggests instead."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
