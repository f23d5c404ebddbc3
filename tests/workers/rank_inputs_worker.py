"""What each gloo rank runs for tests/parallel/test_rank_inputs.py: models and files that look alike to every check
that reads shapes, but whose values differ by layout or by rank. Every case runs in one spawned job."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.core.registry import families
from conformance_worker import inputs as family_inputs, make, output
from flux2_testing import assert_unchanged, build, inputs, rel_err, small_config, snapshot

CONFIG = small_config("tp_wide")


def stored_transposed(model: nn.Module) -> nn.Module:
    """Every Linear's weight with the same values, laid out column-major (`w.t().contiguous().t()`)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()
    return model


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def transposed_storage(mesh: DeviceMesh, src_data_rank: int | None) -> dict:
    """Forward and gradients of the sharded column-major model against the single-device model."""
    kw = inputs(CONFIG, seed=1)
    reference = build(CONFIG)
    expected = reference(**kw, return_dict=False)[0]
    expected.square().mean().backward()
    model = surgery.tensor_parallel(surgery.unfuse(stored_transposed(build(CONFIG))), mesh,
                                    src_data_rank=src_data_rank)
    out = model(**kw, return_dict=False)[0]
    out.square().mean().backward()
    grads = dict(model.named_parameters())
    # the parameters both models hold under one name (every Linear that unfuse leaves as it is)
    shared = [n for n, p in reference.named_parameters() if n in grads]
    return {
        "forward": rel_err(out.detach(), expected.detach()),
        "grad": max(rel_err(whole(grads[n].grad), p.grad) for n, p in reference.named_parameters() if n in grads),
        "compared": len(shared),
    }


def gradients_against_one_device(model: nn.Module, reference: nn.Module, kw: dict) -> dict[str, float]:
    """Each parameter both models hold under one name: the relative error of its gradient after one backward."""
    for m in (model, reference):
        m(**kw, return_dict=False)[0].square().mean().backward()
    grads = dict(model.named_parameters())
    return {n: rel_err(whole(grads[n].grad), p.grad) for n, p in reference.named_parameters() if n in grads}


def filtered(mesh: DeviceMesh, keep) -> dict:
    """`tensor_parallel` with `filter_fn=keep`: the error it raised (the model then as it was), else the worst
    gradient of the q/k norms and of every parameter against the single-device model."""
    kw = inputs(CONFIG, seed=2)
    model = surgery.unfuse(build(CONFIG))
    snap = snapshot(model)
    try:
        surgery.tensor_parallel(model, mesh, filter_fn=keep)
    except surgery.SurgeryError as error:
        assert_unchanged(model, snap)
        return {"error": str(error)}
    errors = gradients_against_one_device(model, build(CONFIG), kw)
    return {"error": None, "norm_grad": max(e for n, e in errors.items() if ".norm_" in n),
            "grad": max(errors.values())}


class Wrapper:
    """What a user writes to log or tweak attention: the processor it holds, called as it is."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, attn, *args, **kwargs):
        return self.inner(attn, *args, **kwargs)


def wrap_processors(model: nn.Module) -> list[str]:
    """Every attention's processor wrapped; the wrapped processors' classes."""
    wrapped = set()
    for module in model.modules():
        if getattr(module, "processor", None) is not None:
            wrapped.add(type(module.processor).__name__)
            module.processor = Wrapper(module.processor)
    return sorted(wrapped)


def wrapped_after_unfuse(mesh: DeviceMesh, name: str) -> dict:
    """The user's model (stock processors wrapped) against the same wrapper set after `unfuse`, sharded."""
    family, config, reference = make(name, next(iter(families()[name].test_configs)))
    kw = family_inputs(family, config, seed=3)
    wrap_processors(reference)
    with torch.no_grad():
        expected = output(reference, kw)
        model = surgery.unfuse(make(name, next(iter(family.test_configs)))[2])
        wrapped = wrap_processors(model)
        surgery.tensor_parallel(model, mesh)
        return {"forward": rel_err(output(model, kw), expected), "wrapped": wrapped}


def run(rank: int, world: int) -> dict:
    mesh = DeviceMesh("cpu", list(range(world)))
    out = {f"transposed_{src}": transposed_storage(mesh, src) for src in (0, None)}
    out["norms_whole"] = filtered(mesh, lambda module, fqn: ".norm_" not in fqn)
    out["attention_whole"] = filtered(mesh, lambda module, fqn: ".attn." not in fqn)
    out["sana_wrapped"] = wrapped_after_unfuse(mesh, "sana")
    return out
