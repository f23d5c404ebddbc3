"""LoRA adapters across the rewrite: split an adapter trained on fused Linears along the same rows/columns, or join.

A LoRA on `W` [out, in] adds `B @ A` (B [out, r], A [r, in]). Rows `W[a:b]` get `B[a:b] @ A`; columns `W[:, a:b]`
get `B @ A[:, a:b]`. Joining is exact too: equal shared factors collapse back to rank r, otherwise the factors are
stacked block-diagonally (rank r x parts).
"""

from __future__ import annotations

from typing import Mapping

import torch

from .checks import SurgeryError
from .slicing import Slice, group_by_fused

_FACTORS = ("lora_A", "lora_B")


def _module(param: str) -> str:
    if not param.endswith(".weight"):
        raise SurgeryError(f"LoRA targets Linear weights; got a slice of {param!r}.")
    return param[: -len(".weight")]


def _keys(module: str) -> tuple[str, str]:
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def _check_plain(state_dict: Mapping[str, torch.Tensor]) -> None:
    odd = [k for k in state_dict if not any(f".{f}.weight" in k for f in _FACTORS)]
    if odd:
        raise SurgeryError(
            f"only plain LoRA factors (lora_A / lora_B weights) can be split; {odd[0]!r} is not one (DoRA magnitudes "
            "and LoRA biases are not supported)."
        )


def unfuse_lora_state_dict(state_dict: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict[str, torch.Tensor]:
    """An adapter on the fused modules (keys `<module>.lora_A.weight` / `.lora_B.weight`) for the unfused modules."""
    _check_plain(state_dict)
    out = dict(state_dict)
    for fused, group in group_by_fused([s for s in slices if s.fused.endswith(".weight")]):
        a_key, b_key = _keys(_module(fused))
        if a_key not in state_dict:
            continue
        a, b = out.pop(a_key), out.pop(b_key)
        for s in group:
            a_new, b_new = _keys(_module(s.unfused))
            if s.dim == 0:
                out[a_new], out[b_new] = a.clone(), b[s.start : s.stop].clone()
            else:
                out[a_new], out[b_new] = a[:, s.start : s.stop].clone(), b.clone()
    return out


def fuse_lora_state_dict(state_dict: Mapping[str, torch.Tensor], slices: list[Slice]) -> dict[str, torch.Tensor]:
    """The inverse of `unfuse_lora_state_dict`: an adapter on the unfused modules for the fused ones, exactly."""
    _check_plain(state_dict)
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
