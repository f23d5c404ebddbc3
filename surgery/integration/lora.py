"""LoRA adapters across the rewrite: split an adapter trained on fused Linears along the same rows/columns, or join.

A LoRA on `W` [out, in] adds `B @ A` (B [out, r], A [r, in]). Rows `W[a:b]` get `B[a:b] @ A`; columns `W[:, a:b]`
get `B @ A[:, a:b]`. Joining is exact too: equal shared factors collapse back to rank r, otherwise the factors are
stacked block-diagonally (rank r x parts).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.utils import convert_unet_state_dict_to_peft
import json
import math
import safetensors.torch

from surgery.core.errors import SurgeryError
from surgery.core.optional import need
from surgery.core.slicing import Slice, group_by_fused
from surgery.core.heads_padding import trims
from surgery.core.state_dict import checkpoint_slices, weight_slices

_FACTORS = ("lora_A", "lora_B")


def _module(param: str) -> str:
    if not param.endswith(".weight"):
        raise SurgeryError(f"LoRA targets Linear weights; got a slice of {param!r}.")
    return param[: -len(".weight")]


def _keys(module: str) -> tuple[str, str]:
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def _check_plain(state_dict: Mapping[str, torch.Tensor], modules: set[str] | None = None) -> None:
    """Refuse what cannot be split or joined exactly: anything but plain factors on `modules` (the fused modules or
    their parts; every module where None). Keys of other modules (a DoRA magnitude or LoRA bias on a module that
    `unfuse` never touches) pass through unchanged."""
    odd = [k for k in state_dict if not any(f".{f}.weight" in k for f in _FACTORS)
           and (modules is None or k.split(".lora_")[0] in modules)]
    if odd:
        raise SurgeryError(
            f"only plain LoRA factors (lora_A / lora_B weights) can be split; {odd[0]!r} is not one (DoRA magnitudes "
            "and LoRA biases are not supported)."
        )


def _split(state_dict: Mapping[str, torch.Tensor], slices: list[Slice],
           unfused_ok: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    """`state_dict` with every fused module's factors split into its parts' factors; and how many modules were split.

    `unfused_ok`: factors of a module whose unfused part has the fused module's name (FLUX.2's single-stream
    `attn.to_out`) and the part's width are already in the unfused layout (an adapter saved with plain PEFT from the
    unfused model): they are kept as they are instead of refused.
    """
    out = dict(state_dict)
    count = 0
    for fused, group in group_by_fused([s for s in slices if s.fused.endswith(".weight")]):
        a_key, b_key = _keys(_module(fused))
        if a_key not in state_dict or b_key not in state_dict:
            continue
        a, b = out.pop(a_key), out.pop(b_key)
        width = b.shape[0] if group[0].dim == 0 else a.shape[1]
        if width != group[-1].stop:
            same_name = next((s for s in group if _module(s.unfused) == _module(fused)), None)
            if same_name is not None and width == same_name.size:
                if unfused_ok:
                    out[a_key], out[b_key] = a, b
                    continue
                raise SurgeryError(
                    f"the adapter's '{_module(fused)}' factors already have the unfused module's width ({width}): "
                    "it is already in the unfused layout. Load it as it is: model.load_lora_adapter(...) on the "
                    "unfused model takes either layout (or inject it with PEFT's set_peft_model_state_dict)."
                )
            raise SurgeryError(
                f"the adapter's {b_key if group[0].dim == 0 else a_key} has shape "
                f"{tuple((b if group[0].dim == 0 else a).shape)}, but '{_module(fused)}' has {group[-1].stop} "
                f"{'rows' if group[0].dim == 0 else 'columns'}: it was trained on another model or config."
            )
        for s in group:
            a_new, b_new = _keys(_module(s.unfused))
            if s.dim == 0:
                out[a_new], out[b_new] = a.clone(), b[s.start : s.stop].clone()
            else:
                out[a_new], out[b_new] = a[:, s.start : s.stop].clone(), b.clone()
        count += 1
    return out, count


def _adapter_prefix(state_dict: Mapping[str, torch.Tensor], modules: set[str]) -> str | None:
    """The prefix before the model's module names in the adapter's keys ('' or 'transformer.'); None if none match."""
    found: set[str] = set()
    for key in state_dict:
        module = key.split(".lora_")[0]
        if module in modules:
            found.add("")
            continue
        hit = next((m for m in modules if module.endswith("." + m)), None)
        if hit is not None:
            found.add(module[: -len(hit)])
    if len(found) > 1:
        raise SurgeryError(
            f"the adapter's keys name the model's modules under several prefixes {sorted(found)}: pass one "
            "component's keys, e.g. {k: v for k, v in adapter.items() if k.startswith('transformer.')}."
        )
    return found.pop() if found else None


def unfuse_lora_state_dict(state_dict: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict[str, torch.Tensor]:
    """An adapter on the fused modules (keys `<module>.lora_A.weight` / `.lora_B.weight`) for the unfused modules.

    Keys may carry a prefix (`transformer.`, as `lora_state_dict` returns them): those keys are split and keep it;
    keys under another prefix pass through. An adapter that names none of the fused modules is refused.
    """
    weights = [s for s in slices if s.fused.endswith(".weight")]
    fused = {_module(s.fused) for s in weights}
    prefix = _adapter_prefix(state_dict, fused)
    _check_plain(state_dict, {(prefix or "") + m for m in fused})
    if prefix is None:
        parts = {_module(s.unfused) for s in weights} - fused
        split = _adapter_prefix(state_dict, parts) is not None
        first = next(iter(state_dict), None)
        raise SurgeryError(
            f"surgery.lora.unfuse_lora_state_dict: none of the adapter's {len(state_dict)} keys (first {first!r}) is on one "
            f"of the {len(fused)} fused modules of the key map (e.g. {sorted(fused)[:1]}). "
            + ("It is already in the unfused layout: load it as it is (model.load_lora_adapter on the unfused "
               "model takes either layout)."
               if split else "Pass surgery.state_dict.weight_slices(model) of the model it was trained for; an adapter that targets no "
               "fused module needs no split.")
        )
    mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    out, _ = _split(mine, slices)
    others = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
    return {**others, **{prefix + k: v for k, v in out.items()}}


def lora_target_modules(model: torch.nn.Module, target_modules) -> list[str]:
    """A PEFT `target_modules` written for the stock model, as the full names of the same layers in `model`.

    `target_modules` is what a stock `LoraConfig` takes (names, suffixes or a regex). Each stock Linear it selects is
    listed by name, a fused one as its unfused parts (to_qkv_mlp_proj -> to_q, to_k, to_v, mlp.linear_gate,
    mlp.linear_up): pass the result as `LoraConfig(target_modules=...)` on the unfused model so that training touches
    exactly the stock layers.
    """
    LoraConfig = need("peft", "LoRA adapters").LoraConfig
    check_target_module_exists = need("peft.tuners.tuners_utils", "LoRA adapters").check_target_module_exists


    config = LoraConfig(target_modules=target_modules)
    parts: dict[str, list[str]] = {}
    for fused, group in group_by_fused([s for s in weight_slices(model) if s.fused.endswith(".weight")]):
        parts.setdefault(_module(fused), []).extend(_module(s.unfused) for s in group)
    unfused = {p for ps in parts.values() for p in ps}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in unfused]
    names: list[str] = []
    for name in sorted({*linears, *parts}):
        if check_target_module_exists(config, name):
            names += parts.get(name, [name])
    if not names:
        raise SurgeryError(
            f"surgery.lora.lora_target_modules: target_modules={target_modules!r} selects no Linear of "
            f"{type(model).__name__} (stock names such as {sorted(parts)[:2]} are accepted)."
        )
    return sorted(set(names))


def fuse_lora_state_dict(state_dict: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict[str, torch.Tensor]:
    """The inverse of `unfuse_lora_state_dict`: an adapter on the unfused modules for the fused ones, exactly."""
    _check_plain(state_dict, {_module(s.unfused) for s in slices if s.fused.endswith(".weight")})
    out = dict(state_dict)
    for fused, group in group_by_fused([s for s in slices if s.fused.endswith(".weight")]):
        parts = [_keys(_module(s.unfused)) for s in group]
        present = [a in state_dict for a, _ in parts]
        if not any(present):
            continue
        if not all(present):
            missing = next(a for (a, _), here in zip(parts, present) if not here)
            raise SurgeryError(f"the adapter covers part of '{fused}' but not {missing!r}: it cannot be joined.")
        a_parts = [out.pop(a) for a, _ in parts]
        b_parts = [out.pop(b) for _, b in parts]
        a_key, b_key = _keys(_module(fused))
        if group[0].dim == 0:  # rows: B stacks; A is shared if untouched
            same = all(torch.equal(a, a_parts[0]) for a in a_parts)
            out[a_key] = a_parts[0] if same else torch.cat(a_parts, dim=0)
            out[b_key] = torch.cat(b_parts, dim=0) if same else torch.block_diag(*b_parts)
        else:  # columns: A stacks; B is shared if untouched
            same = all(torch.equal(b, b_parts[0]) for b in b_parts)
            out[a_key] = torch.cat(a_parts, dim=1) if same else torch.block_diag(*a_parts)
            out[b_key] = b_parts[0] if same else torch.cat(b_parts, dim=1)
    return out


# --- adapter configs (PEFT `LoraConfig` dicts, as diffusers stores them beside the weights) ------------------------


def _fused_modules(slices: list[Slice]) -> dict[str, list[str]]:
    """Fused module -> its unfused parts' modules, in order (weights only)."""
    return {
        _module(fused): [_module(s.unfused) for s in group]
        for fused, group in group_by_fused([s for s in slices if s.fused.endswith(".weight")])
    }


def split_adapter_config(config: dict, split: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict:
    """A `LoraConfig` dict written for the stock modules, for the adapter `split` by `unfuse_lora_state_dict`.

    Targets become the split adapter's modules by full name; each part keeps its fused module's rank and alpha.
    """
    get_pattern_key = need("peft.utils.other", "LoRA adapters").get_pattern_key

    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    alpha_pattern = dict(config.get("alpha_pattern") or {})
    stock_of = {p: f for f, parts in _fused_modules(slices).items() for p in parts}
    modules = sorted({k.split(".lora_")[0] for k in split if ".lora_A." in k})
    ranks, alphas = {}, {}
    for m in modules:
        rank = split[f"{m}.lora_A.weight"].shape[0]
        a = alpha_pattern.get(get_pattern_key(list(alpha_pattern), stock_of.get(m, m)), alpha)
        if rank != r:
            ranks[f"^{m}"] = rank
        if a != alpha:
            alphas[f"^{m}"] = a
    return {**config, "target_modules": modules, "rank_pattern": ranks, "alpha_pattern": alphas}


def _real_heads(state: dict[str, torch.Tensor], trimmed: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """An adapter's factors with the zero heads of a padded model cut off: lora_B's rows of a padded q/k/v, lora_A's
    columns of a padded output projection (`surgery.core.heads_padding.trims`)."""
    out = dict(state)
    for name, (dim, real) in trimmed.items():
        module, _, leaf = name.rpartition(".")
        factor = f"{module}.lora_B.{leaf}" if dim == 0 else f"{module}.lora_A.{leaf}"
        if factor in out:
            out[factor] = out[factor].narrow(dim, 0, real).contiguous()
    return out


def stock_lora_adapter(model: torch.nn.Module, adapter_name: str = "default") -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter `adapter_name` of an unfused model in the stock model's names, and its `LoraConfig` dict.

    What stock diffusers loads: pass them to `save_lora_weights(..., transformer_lora_layers=state_dict,
    transformer_lora_adapter_metadata=config)`. Parts of one fused module join exactly (`fuse_lora_state_dict`);
    their scale (alpha / r) is carried by each fused module's alpha, or folded into lora_B where the parts' scales
    differ.
    """

    BaseTunerLayer = need("peft.tuners.tuners_utils", "LoRA adapters").BaseTunerLayer
    get_peft_model_state_dict = need("peft.utils", "LoRA adapters").get_peft_model_state_dict


    if adapter_name not in getattr(model, "peft_config", {}):
        raise SurgeryError(f"the model has no LoRA adapter named {adapter_name!r}.")
    config = model.peft_config[adapter_name].to_dict()
    slices = checkpoint_slices(model)
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    # a tensor-parallel model's factors are DTensors: gather them one factor at a time (every rank calls this, in
    # the same order), never the model
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    state = _real_heads(state, trims(model))
    # each layer's scale as loaded (alpha / r): `scaling` also holds the weight `set_adapters` gave the adapter,
    # which is a setting of the model, not part of the adapter (stock diffusers saves the adapter without it)
    scale = {
        name: layer.lora_alpha[adapter_name] / (math.sqrt(layer.r[adapter_name])
                                                if layer.use_rslora.get(adapter_name) else layer.r[adapter_name])
        for name, layer in model.named_modules()
        if isinstance(layer, BaseTunerLayer) and adapter_name in getattr(layer, "scaling", {})
    }
    fused_scale: dict[str, float] = {}
    for fused, parts in _fused_modules(slices).items():
        present = [p for p in parts if f"{p}.lora_A.weight" in state]
        if not present:
            continue
        if len({scale[p] for p in present}) > 1:  # one fused alpha cannot hold them: fold each into its lora_B
            for p in present:
                state[f"{p}.lora_B.weight"] = state[f"{p}.lora_B.weight"] * scale[p]
            fused_scale[fused] = 1.0
        else:
            fused_scale[fused] = scale[present[0]]
    joined = fuse_lora_state_dict(state, slices)
    r, alpha = config["r"], config["lora_alpha"]
    modules = sorted({k.split(".lora_")[0] for k in joined if ".lora_A." in k})
    ranks, alphas = {}, {}
    for m in modules:
        rank = joined[f"{m}.lora_A.weight"].shape[0]
        a = fused_scale.get(m, scale.get(m, alpha / r)) * (math.sqrt(rank) if config.get("use_rslora") else rank)
        if rank != r:
            ranks[f"^{m}"] = rank
        if not math.isclose(a, alpha, rel_tol=1e-12):
            alphas[f"^{m}"] = a
    return joined, {**config, "target_modules": modules, "rank_pattern": ranks, "alpha_pattern": alphas}


# ---- adapter files in diffusers' format ----------------------------------------------------------------------------

def split_adapter(model: nn.Module, state_dict: dict, prefix: str | None, metadata: dict | None,
                  network_alphas: dict | None) -> tuple[dict, dict | None, dict | None]:
    """An adapter in stock names (diffusers' format, keys under `prefix.`) split for `model`'s unfused modules."""


    slices = weight_slices(model)
    head = f"{prefix}." if prefix else ""
    mine = {k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)}
    if not mine:
        return state_dict, metadata, network_alphas
    if "lora_A" not in next(iter(mine)):  # what diffusers does next; done first so that the keys are PEFT's
        mine = convert_unet_state_dict_to_peft(mine)
    fused = {s.fused[: -len(".weight")] for s in slices if s.fused.endswith(".weight")}
    odd = [k for k in mine if k.rpartition(".lora_")[0] in fused or k.rpartition(".lokr_")[0] in fused
           or k.rpartition(".")[0] in fused]
    odd = [k for k in odd if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if odd:
        raise SurgeryError(
            f"{type(model).__name__}.load_lora_adapter: '{head}{odd[0]}' is not a plain LoRA factor (a DoRA "
            "magnitude, LoRA bias or LoKr factor) of a fused module, which cannot be split exactly. Load it into the "
            "stock model, merge it (fuse_lora(); unload_lora()), then surgery.unfuse."
        )
    split, _ = _split(mine, slices, unfused_ok=True)
    out = {**{k: v for k, v in state_dict.items() if not k.startswith(head)}, **{head + k: v for k, v in split.items()}}
    if metadata is not None:
        config = {k[len(head):]: v for k, v in metadata.items() if k.startswith(head)}
        if config:
            config = split_adapter_config(config, split, slices)
            metadata = {**{k: v for k, v in metadata.items() if not k.startswith(head)},
                        **{head + k: v for k, v in config.items()}}
    if network_alphas:
        parts = {}
        for fused, group in group_by_fused([s for s in slices if s.fused.endswith(".weight")]):
            parts[fused[: -len(".weight")]] = [s.unfused[: -len(".weight")] for s in group]
        expanded = {}
        for key, alpha in network_alphas.items():
            module, _, leaf = key[len(head):].rpartition(".")
            if key.startswith(head) and module in parts:
                expanded.update({f"{head}{p}.{leaf}": alpha for p in parts[module]})
            else:
                expanded[key] = alpha
        network_alphas = expanded
    return out, metadata, network_alphas


def write_adapter(path, state_dict: dict, config: dict, safe_serialization: bool = True) -> None:
    """The adapter file diffusers' `save_lora_adapter` writes: safetensors with the `LoraConfig` in its metadata."""


    if safe_serialization:
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        metadata = {"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)}
        safetensors.torch.save_file({k: v.contiguous() for k, v in state_dict.items()}, path, metadata=metadata)
    else:
        torch.save(state_dict, path)
