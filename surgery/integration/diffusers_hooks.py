"""diffusers' life cycle on an unfused model, in the stock layout: checkpoints and LoRA adapters keep stock names.

`install(model)` (run at the end of `unfuse` and `fuse`) gives every diffusers model inside `model` that holds
unfused modules four instance-level methods, which shadow the class's and call it:

- `add_adapter`: a `LoraConfig`'s `target_modules` selects the layers it selects on the stock model
  (`stock_targets`), so that an adapter trained on the unfused model is the stock adapter, split.

- `save_pretrained`: diffusers' own writer, reading the fused layout (`saving.fused_layout`), so the files are
  bitwise what `fuse` + `save_pretrained` writes; a tensor-parallel model goes to `surgery.save_pretrained`.
- `load_lora_adapter` (what `pipe.load_lora_weights` calls): an adapter in stock names is split
  (`unfuse_lora_state_dict`, its `LoraConfig` by `split_adapter_config`) before diffusers reads it.
- `save_lora_adapter`: writes the adapter in stock names (`stock_lora_adapter`).

and every unfused module a `load_state_dict` pre-hook that splits fused keys, so `load_state_dict` takes either
layout. `state_dict()` itself stays unfused: its keys match `named_parameters()`, which torch's distributed
checkpoint, FSDP2, PEFT and optimizers need. A model with no unfused module left loses all of these.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from diffusers.loaders.lora_base import LORA_WEIGHT_NAME
from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE
from diffusers.loaders.lora_base import _fetch_state_dict
from diffusers.utils.peft_utils import get_adapter_name
from pathlib import Path
import copy
import os
import re

from surgery.core.checks import SURGERY_LOAD_HOOK
from surgery.core.errors import SurgeryError
from surgery.core.optional import need
from surgery.core.registry import registered
from surgery.core.slicing import group_by_fused, take
from surgery.core.state_dict import weight_slices
from surgery.core.walk import find_modules
from surgery.integration.lora import _module, lora_target_modules, split_adapter, stock_lora_adapter, write_adapter
from surgery.integration.lora_tp import load_sharded, save_sharded
from surgery.io import saving

_HOOK_ATTR = SURGERY_LOAD_HOOK  # the checks recognise it as surgery's own


def _is_diffusers_model(module: nn.Module) -> bool:
    return hasattr(type(module), "save_pretrained") and hasattr(module, "save_config")


def install(model: nn.Module) -> None:
    """Give the diffusers models in `model` that hold unfused modules the stock-layout methods; remove them
    elsewhere."""
    for module in model.modules():
        if not _is_diffusers_model(module):
            continue
        if find_modules(module, fused=False):
            for name in _METHODS:
                if hasattr(type(module), name):
                    setattr(module, name, _Shadow(module, name))
        else:
            for name in _METHODS:
                vars(module).pop(name, None)
    for _, module, rewrite in find_modules(model, fused=False):
        if rewrite.in_checkpoints and getattr(module, _HOOK_ATTR, None) is None:
            handle = module.register_load_state_dict_pre_hook(_split_fused_keys)
            object.__setattr__(module, _HOOK_ATTR, handle)


class _Shadow:
    """The method `name` of `module`'s class, with surgery's version in its place: an instance attribute.

    It shows the class method's signature (diffusers' pipelines read it to pick keyword arguments), and a model that
    holds it still pickles and deep-copies (the copy's method is bound to the copy).
    """

    def __init__(self, module: nn.Module, name: str):
        self.__self__ = module
        self.__name__ = name

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(getattr(type(self.__self__), self.__name__).__get__(self.__self__))

    @property
    def __doc__(self) -> str | None:
        return _METHODS[self.__name__].__doc__

    def __call__(self, *args, **kwargs):
        return _METHODS[self.__name__](self.__self__, *args, **kwargs)


def remove(model: nn.Module) -> None:
    """Undo `install` on every module of `model`."""
    for module in model.modules():
        for name in _METHODS:
            vars(module).pop(name, None)
        handle = vars(module).pop(_HOOK_ATTR, None)
        if handle is not None:
            handle.remove()


# --- load_state_dict: either layout ---------------------------------------------------------------------------------


def _split_fused_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Replace the fused keys of this unfused module in `state_dict` by its parts (row slices are views).

    What cannot be right is reported the way torch reports a size mismatch (in `error_msgs`, so `load_state_dict`
    raises even with strict=False): a fused tensor of another size, and a state dict holding both a fused key and its
    parts. The module's own tensors stand in for the parts then, so the error names the cause (not missing keys) and
    this module's parameters keep their values.
    """
    rewrite = next((r for r in _registered() if r.matches_unfused(module)), None)
    if rewrite is None:
        return
    for fused, group in group_by_fused(rewrite.slices(module)):
        tensor = state_dict.get(prefix + fused)
        if tensor is None:
            continue
        dim, total = group[0].dim, group[-1].stop
        fits = tensor.dim() > dim and tensor.shape[dim] == total
        own = {s.unfused: _own(module, s.unfused) for s in group}
        if len(group) == 1 and group[0].unfused == fused and not fits:
            continue  # the unfused key of the same name (its own size is torch's to check)
        if not fits:
            if fused in own and tensor.shape == own[fused].shape:
                continue  # `to_out.weight` of the unfused layout: a key of both layouts
            expected = list(own[group[0].unfused].shape)
            expected[dim] = total
            error_msgs.append(
                f"size mismatch for {prefix}{fused}: copying a param with shape {tensor.shape} from checkpoint, the "
                f"shape in current model is {torch.Size(expected)} (fused from {', '.join(own)}: a checkpoint of "
                "another config?)."
            )
        else:
            both = sorted(prefix + name for name in own if name != fused and prefix + name in state_dict)
            if not both:
                if len(group) == 1 and group[0].unfused == fused:
                    continue  # the same key and shape in both layouts
                del state_dict[prefix + fused]
                for s in group:
                    state_dict[prefix + s.unfused] = take(tensor, s)[0]
                continue
            error_msgs.append(
                f"{prefix}{fused} and its unfused parts ({', '.join(both)}) are both in the state dict: which should "
                "load is ambiguous. Pass one layout (the fused one as diffusers writes it, or the unfused one of "
                "model.state_dict())."
            )
        del state_dict[prefix + fused]
        for name, value in own.items():  # nothing of this module changes; load_state_dict raises at its end
            state_dict[prefix + name] = value


def _own(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf).detach()


def _registered():
    return registered()


# --- save_pretrained ------------------------------------------------------------------------------------------------


def _save_pretrained(self, save_directory, *args, **kwargs):
    """diffusers' `save_pretrained`, writing the stock (fused) layout. See `surgery.io.saving`."""

    stock = type(self).save_pretrained
    if saving.is_sharded(self):
        bound = inspect.signature(stock).bind(self, save_directory, *args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        supported = {"self", "save_directory", "is_main_process", "max_shard_size", "variant", "safe_serialization"}
        odd = sorted(k for k, v in given.items() if k not in supported and v not in (None, False, {}))
        if odd or not given["safe_serialization"]:
            raise SurgeryError(
                f"{type(self).__name__}.save_pretrained: the model is sharded with tensor parallelism; call "
                f"surgery.save_pretrained(model, folder, max_shard_size=...) on every rank instead (it takes no "
                f"{odd or ['safe_serialization=False']}), then upload the folder."
            )
        saving.save_pretrained(self, save_directory, max_shard_size=given["max_shard_size"], variant=given["variant"])
        return
    with saving.fused_layout(self):
        stock(self, save_directory, *args, **kwargs)


# --- LoRA -----------------------------------------------------------------------------------------------------------


def _load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap: bool = False,
                       **kwargs):
    """diffusers' `load_lora_adapter` for an adapter in stock names: split first. See `surgery.integration.diffusers_hooks`."""

    if saving.is_sharded(self):
        return load_sharded(self, pretrained_model_name_or_path_or_dict, prefix, hotswap, kwargs)
    state_dict, metadata = pretrained_model_name_or_path_or_dict, kwargs.pop("metadata", None)
    if not isinstance(state_dict, dict):
        state_dict, metadata = _fetch_state_dict(
            pretrained_model_name_or_path_or_dict=state_dict,
            weight_name=kwargs.pop("weight_name", None),
            use_safetensors=kwargs.pop("use_safetensors", None),
            local_files_only=kwargs.pop("local_files_only", None),
            cache_dir=kwargs.pop("cache_dir", None),
            force_download=kwargs.pop("force_download", False),
            proxies=kwargs.pop("proxies", None),
            token=kwargs.pop("token", None),
            revision=kwargs.pop("revision", None),
            subfolder=kwargs.pop("subfolder", None),
            user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"},
            allow_pickle=False,
            metadata=metadata,
        )
    alphas = kwargs.pop("network_alphas", None)
    state_dict, metadata, alphas = split_adapter(self, dict(state_dict), prefix, metadata, alphas)
    return type(self).load_lora_adapter(
        self, state_dict, prefix=prefix, hotswap=hotswap, metadata=metadata, network_alphas=alphas, **kwargs
    )


def _save_lora_adapter(self, save_directory, adapter_name: str = "default", upcast_before_saving: bool = False,
                       safe_serialization: bool = True, weight_name: str | None = None):
    """diffusers' `save_lora_adapter`, in the stock model's names (`surgery.lora.stock_lora_adapter`)."""



    if adapter_name is None:
        adapter_name = get_adapter_name(self)
    if saving.is_sharded(self):  # every check there, agreed by the ranks: one rank's refusal raises on all at once
        return save_sharded(self, save_directory, adapter_name, safe_serialization, weight_name, upcast_before_saving)
    if adapter_name not in getattr(self, "peft_config", {}):  # diffusers' own check and message, first
        raise ValueError(f"Adapter name {adapter_name} not found in the model.")

    if upcast_before_saving:
        self.to(dtype=torch.float32)
    state_dict, config = stock_lora_adapter(self, adapter_name)
    if os.path.isfile(save_directory):
        raise ValueError(f"Provided path ({save_directory}) should be a directory, not a file")
    os.makedirs(save_directory, exist_ok=True)
    path = Path(save_directory, weight_name or (LORA_WEIGHT_NAME_SAFE if safe_serialization else LORA_WEIGHT_NAME))
    write_adapter(path, state_dict, config, safe_serialization)


def stock_targets(model: nn.Module, target_modules):
    """A `target_modules` as stock diffusers reads it, for `model`'s unfused modules: the stock Linears it selects
    (a fused one as its parts, `surgery.lora.lora_target_modules`) plus any unfused part named in full, as one regex of
    full names. None where that
    selects nothing (PEFT then raises its own error) or for PEFT's "all-linear" shorthand (the same on both forms).

    Without it, a stock name selects other layers on the unfused model: a new part's name may end like a stock
    module's (`to_q`), and a fused module's name (`to_qkv_mlp_proj`, `proj_out`) no longer names a Linear.
    """
    INCLUDE_LINEAR_LAYERS_SHORTHAND = need("peft.utils.constants", "LoRA adapters").INCLUDE_LINEAR_LAYERS_SHORTHAND


    if target_modules is None or target_modules == INCLUDE_LINEAR_LAYERS_SHORTHAND:
        return None
    names: set[str] = set()
    try:
        names |= set(lora_target_modules(model, target_modules))
    except SurgeryError:
        pass
    if not isinstance(target_modules, str):
        parts = {_module(s.unfused) for s in weight_slices(model) if s.unfused.endswith(".weight")}
        names |= {t for t in target_modules if t in parts}
    if not names:
        return None
    # one regex PEFT full-matches: a list entry is also a suffix ('proj_out' would pick 'blocks.0.proj_out' too)

    return "^(?:" + "|".join(re.escape(n) for n in sorted(names)) + ")$"


def _add_adapter(self, adapter_config, adapter_name: str = "default"):
    """diffusers' `add_adapter`, with `target_modules` selecting the layers it selects on the stock model."""

    if getattr(adapter_config, "use_dora", False) and any(
            hasattr(p, "device_mesh") for p in self.parameters()):  # a DTensor: sharded by surgery.tensor_parallel
        raise SurgeryError(
            f"{type(self).__name__}.add_adapter: DoRA is not supported on a sharded model; its weight norm needs each "
            "whole base weight, which no rank holds. Add the DoRA adapter before surgery.tensor_parallel and merge it "
            "(`fuse_lora()` / peft's `merge_and_unload()`), or use plain LoRA (use_dora=False) on the sharded model.")
    targets = stock_targets(self, getattr(adapter_config, "target_modules", None))
    if targets is not None:
        adapter_config = copy.copy(adapter_config)
        adapter_config.target_modules = targets
    return type(self).add_adapter(self, adapter_config, adapter_name=adapter_name)


_METHODS = {
    "add_adapter": _add_adapter,
    "save_pretrained": _save_pretrained,
    "load_lora_adapter": _load_lora_adapter,
    "save_lora_adapter": _save_lora_adapter,
}
