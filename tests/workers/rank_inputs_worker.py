"""What each gloo rank runs for tests/parallel/test_rank_inputs.py: models and files that look alike to every check
that reads shapes, but whose values differ by layout or by rank. Every case runs in one spawned job."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from peft import LoraConfig
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.core.registry import families
from conformance_worker import inputs as family_inputs, make, output
from surgery.io.sliced_files import SafetensorsFile
from flux2_testing import assert_unchanged, build, inputs, rel_err, small_config, snapshot
from gguf_testing import write_fp8, write_gguf
from lora_tp_worker import pipeline_class, publish, random_adapter

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
    family, config, reference = make(name, next(iter(families()[name].tests.configs)))
    kw = family_inputs(family, config, seed=3)
    wrap_processors(reference)
    with torch.no_grad():
        expected = output(reference, kw)
        model = surgery.unfuse(make(name, next(iter(family.tests.configs)))[2])
        wrapped = wrap_processors(model)
        surgery.tensor_parallel(model, mesh)
        return {"forward": rel_err(output(model, kw), expected), "wrapped": wrapped}


def refused(call) -> str | None:
    try:
        call()
    except surgery.SurgeryError as error:
        return str(error)
    return None


KINDS = {"folder": "folder", "gguf": "gguf/model.gguf", "fp8": "fp8/model.safetensors", "adapter": "adapter"}


def checkpoint(root: Path, rank: int, kind: str) -> Path:
    """Where rank `rank`'s checkpoint of `kind` lies (written by `write_checkpoints`)."""
    return root / f"rank{rank}" / KINDS[kind]


def write_checkpoints(root: Path, seed: int) -> None:
    """The model seeded `seed` as a diffusers folder, a GGUF file and an fp8 file (each with its config.json), and a
    LoRA adapter seeded alike."""
    model = build(CONFIG, seed=seed)
    model.save_pretrained(checkpoint(root, seed, "folder"))
    for kind in ("gguf", "fp8"):
        checkpoint(root, seed, kind).parent.mkdir(parents=True)
    write_gguf(model, checkpoint(root, seed, "gguf"), "F32")
    write_fp8(model, checkpoint(root, seed, "fp8"))
    adapter = random_adapter(model, seed, 4, 8, ["to_q", "to_k", "to_v", "to_out.0"])
    publish(pipeline_class("Flux2Pipeline"), *adapter, checkpoint(root, seed, "adapter"))


def replaced_while_read(rank: int, root: Path, load) -> str | None:
    """Both ranks load one path; rank 1 replaces the file (another checkpoint, renamed over it) once rank 0 has opened
    it, so rank 0 reads the old file and rank 1 the new one."""
    shared, opened = root / "shared" / "model.safetensors", root / "shared" / "rank 0 opened it"

    class Racing(SafetensorsFile):
        def __init__(self, path):
            if rank == 1:
                deadline = time.monotonic() + 20
                while not opened.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                shutil.copy(checkpoint(root, 1, "fp8"), shared.with_suffix(".new"))
                os.replace(shared.with_suffix(".new"), shared)
            super().__init__(path)
            if rank == 0:
                opened.touch()

    with mock.patch("surgery.io.loading.SafetensorsFile", Racing):
        return refused(lambda: load(shared))


def different_data(rank: int, world: int, mesh: DeviceMesh, root: Path) -> dict:
    """Each rank given its own checkpoint or adapter (seeded by its rank: the same shapes, other values)."""
    write_checkpoints(root, seed=rank)
    if rank == 0:
        (root / "shared").mkdir()
        for name in ("model.safetensors", "config.json"):
            shutil.copy(checkpoint(root, 0, "fp8").with_name(name), root / "shared" / name)
    dist.barrier()  # every rank's files written

    def load(path):
        return surgery.load_tensor_parallel(None, path, mesh, progress=False)

    out = {kind: refused(lambda: load(checkpoint(root, rank, kind))) for kind in ("folder", "gguf", "fp8")}
    out["gguf_or_fp8"] = refused(lambda: load(checkpoint(root, 0, "gguf" if rank == 0 else "fp8")))
    out["same_fp8"] = refused(lambda: load(checkpoint(root, 0, "fp8")))
    out["replaced"] = replaced_while_read(rank, root, load)
    model = surgery.tensor_parallel(surgery.unfuse(build(CONFIG)), mesh)
    out["adapter"] = refused(lambda: model.load_lora_adapter(checkpoint(root, rank, "adapter"), adapter_name="one",
                                                             weight_name="pytorch_lora_weights.safetensors"))
    out["adapter_left"] = sorted(getattr(model, "peft_config", {}))
    torch.manual_seed(rank)  # PEFT draws lora_A at random: each rank its own
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"]), adapter_name="trained")
    snap = snapshot(model)
    out["shard_lora"] = refused(lambda: surgery.lora.shard_lora(model, src_data_rank=None))
    out["shard_lora_kept"] = unchanged(model, snap)
    return out


def unchanged(model: nn.Module, snap: tuple) -> bool:
    try:
        assert_unchanged(model, snap)
    except AssertionError:
        return False
    return True


def run(rank: int, world: int, root: str) -> dict:
    mesh = DeviceMesh("cpu", list(range(world)))
    out = {f"transposed_{src}": transposed_storage(mesh, src) for src in (0, None)}
    out["norms_whole"] = filtered(mesh, lambda module, fqn: ".norm_" not in fqn)
    out["attention_whole"] = filtered(mesh, lambda module, fqn: ".attn." not in fqn)
    out["sana_wrapped"] = wrapped_after_unfuse(mesh, "sana")
    out["different_data"] = different_data(rank, world, mesh, Path(root))
    return out
