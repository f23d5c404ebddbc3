"""What each of 2 gloo ranks runs for tests/integration/test_lora_tp.py: LoRA adapters on a tensor-parallel model, vs the stock
single-device model with the same adapter, for FLUX.2 and FLUX.1. One process per rank runs every operation."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch._dynamo.utils  # noqa: F401 - the compile counters
import torch.nn as nn
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.testing import CollectiveCounter, example_inputs, rel_err, seeded_model

CASES = {  # family -> (pipeline class name, tiny config with heads and widths a mesh of 2 splits)
    "flux2": ("Flux2Pipeline", "dev_small"),
    "flux1": ("FluxPipeline", "tp_dev"),
}


def pipeline_class(name: str):
    import diffusers

    return getattr(diffusers, name)


def block_linears(model) -> list[str]:
    """Every Linear of the transformer blocks, by its stock name: fused, colwise, rowwise and unsharded ones."""
    return sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "transformer_blocks." in n)


def random_adapter(base, seed: int, rank: int, alpha: int, targets):
    """A stock model with a trained-looking adapter (random, nonzero factors): `(model, state dict, config dict)`."""
    model = copy.deepcopy(base)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets), adapter_name="x")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return get_peft_model_state_dict(model, adapter_name="x"), model.peft_config["x"].to_dict()


def publish(pipe_cls, state_dict, config, folder: Path) -> Path:
    """What a stock user publishes: diffusers' `save_lora_weights` with the adapter's config."""
    pipe_cls.save_lora_weights(folder, transformer_lora_layers=state_dict, transformer_lora_adapter_metadata=config)
    return folder


def load_like_a_pipeline(pipe_cls, transformer, folder: Path, name: str, **kw):
    """What `pipe.load_lora_weights(folder, adapter_name=name)` runs, without the rest of the pipeline."""
    import inspect

    state_dict, metadata = pipe_cls.lora_state_dict(folder, return_lora_metadata=True)
    if isinstance(state_dict, tuple):  # FLUX.1's returns (state dict, network alphas)
        state_dict, kw["network_alphas"] = state_dict
    elif "network_alphas" in inspect.signature(pipe_cls.load_lora_into_transformer).parameters:
        kw.setdefault("network_alphas", None)
    pipe_cls.load_lora_into_transformer(state_dict, transformer=transformer, adapter_name=name, metadata=metadata, **kw)


def forward(model, kw):
    with torch.no_grad():
        out = model(**kw, return_dict=False)[0]
    return out.full_tensor() if isinstance(out, DTensor) else out


def local_snapshot(model):
    modules = [(n, id(m), type(m)) for n, m in model.named_modules()]
    params = {n: (id(p), (p.to_local() if isinstance(p, DTensor) else p).detach().clone())
              for n, p in model.named_parameters()}
    return modules, params, sorted(getattr(model, "peft_config", {}))


def unchanged(model, snap) -> bool:
    modules, params, adapters = snap
    if [(n, id(m), type(m)) for n, m in model.named_modules()] != modules:
        return False
    if sorted(getattr(model, "peft_config", {})) != adapters:
        return False
    now = dict(model.named_parameters())
    return now.keys() == params.keys() and all(
        id(now[n]) == i and torch.equal((now[n].to_local() if isinstance(now[n], DTensor) else now[n]).detach(), v)
        for n, (i, v) in params.items())


def refused(model, call) -> str | None:
    snap = local_snapshot(model)
    try:
        call()
    except surgery.SurgeryError as error:
        return str(error) if unchanged(model, snap) else f"CHANGED: {error}"
    return None


def check_family(family_name: str, mesh, root: Path, shared: Path) -> dict:
    family = surgery.extend.families()[family_name]
    pipe_cls = pipeline_class(CASES[family_name][0])
    config = family.tests.configs[CASES[family_name][1]]
    base = seeded_model(family, config, 0)
    kw = example_inputs(family, config, batch=1, seed=0)
    targets = block_linears(base)
    two_targets = [t for t in targets if t.startswith("single_transformer_blocks.")]
    files = {}
    for name, seed, rank, alpha, tg in (("one", 1, 4, 8, targets), ("two", 2, 2, 2, two_targets),
                                       ("swap", 3, 4, 4, targets), ("small", 4, 2, 6, targets),
                                       ("big", 5, 16, 16, targets)):
        state, cfg = random_adapter(base, seed, rank, alpha, tg)
        files[name] = publish(pipe_cls, state, cfg, root / family_name / name)

    def stock_with(*names, weights=None):
        model = copy.deepcopy(base)
        for n in names:
            load_like_a_pipeline(pipe_cls, model, files[n], n)
        model.set_adapters(list(names), weights)
        return model

    def sharded():
        return surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(base)), mesh)

    out: dict = {}
    expected = {"one": forward(stock_with("one"), kw), "swap": forward(stock_with("swap"), kw),
                "small": forward(stock_with("small"), kw), "base": forward(base, kw)}
    both = stock_with("one", "two", weights=[0.7, -0.4])
    expected["one+two"] = forward(both, kw)
    both.fuse_lora(lora_scale=0.5, adapter_names=["one", "two"])
    expected["fused"] = forward(both, kw)
    both.unfuse_lora()
    both.set_adapters(["two"])
    expected["two"] = forward(both, kw)

    model = sharded()
    # a file: each rank reads only its slices (safetensors slices), through the fused -> unfused split
    read = []
    stock_read = surgery.integration.lora_tp.LazyFactor.read

    def counting(self, rows=None, cols=None):
        tensor = stock_read(self, rows, cols)
        read.append(tensor.numel())
        return tensor

    with mock.patch.object(surgery.integration.lora_tp.LazyFactor, "read", counting):
        model.load_lora_adapter(files["one"], adapter_name="one", weight_name="pytorch_lora_weights.safetensors")
    out["elements read"] = sum(read)
    out["elements held"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                               for n, p in model.named_parameters() if "lora_" in n)
    out["elements in the file"] = sum(v.numel() for v in load_file(
        files["one"] / "pytorch_lora_weights.safetensors").values())
    a = model.get_submodule(next(p for p in surgery.integration.lora_tp.linear_styles(model)
                                 if p.startswith("single_transformer_blocks.0")))
    out["placements"] = sorted({f"{type(p).__name__}{tuple(p.placements) if isinstance(p, DTensor) else ''}"
                                for n, p in model.named_parameters() if "lora_" in n})
    with CollectiveCounter() as counter:
        out["load (file, sliced)"] = rel_err(forward(model, kw), expected["one"])
    out["collectives with adapter"] = dict(counter.counts)
    # what pipe.load_lora_weights does: the pipeline's converters, then load_lora_adapter with a state dict
    load_like_a_pipeline(pipe_cls, model, files["two"], "two")
    model.set_adapters(["one", "two"], [0.7, -0.4])
    out["set_adapters with weights (two adapters)"] = rel_err(forward(model, kw), expected["one+two"])
    model.fuse_lora(lora_scale=0.5, adapter_names=["one", "two"])
    out["fuse_lora"] = rel_err(forward(model, kw), expected["fused"])
    model.unfuse_lora()
    model.set_adapters(["two"])
    out["unfuse_lora + set_adapters"] = rel_err(forward(model, kw), expected["two"])
    model.delete_adapters("two")
    model.set_adapters(["one"])
    out["delete_adapters"] = rel_err(forward(model, kw), expected["one"])
    out["adapters left"] = sorted(model.peft_config)

    # save from the sharded model: every rank calls it, rank 0 writes; stock diffusers loads it
    saved = shared / family_name / "saved"
    model.save_lora_adapter(saved, adapter_name="one")
    torch.distributed.barrier()
    stock = copy.deepcopy(base)
    stock.load_lora_adapter(saved, prefix=None, adapter_name="one", weight_name="pytorch_lora_weights.safetensors")
    out["save_lora_adapter -> stock load"] = rel_err(forward(stock, kw), expected["one"])
    original = load_file(files["one"] / "pytorch_lora_weights.safetensors")
    written = load_file(saved / "pytorch_lora_weights.safetensors")
    out["saved keys"] = sorted(written) == sorted(k.removeprefix("transformer.") for k in original)
    out["saved exact"] = all(torch.equal(written[k.removeprefix("transformer.")], v) for k, v in original.items())
    layers, _ = surgery.lora.stock_lora_adapter(model, "one")
    out["stock_lora_adapter plain tensors"] = all(type(v) is torch.Tensor for v in layers.values())

    model.unload_lora()
    out["unload_lora_weights"] = rel_err(forward(model, kw), expected["base"])
    out["no lora left"] = not any("lora_" in n for n, _ in model.named_parameters())

    # hot-swap under torch.compile: enable_lora_hotswap(target_rank) before the first adapter
    from torch import _dynamo

    _dynamo.reset()
    model = sharded()
    model.enable_lora_hotswap(target_rank=8)
    load_like_a_pipeline(pipe_cls, model, files["one"], "default_0")
    compiled = torch.compile(model, backend="eager")
    out["hotswap: compiled, first adapter"] = rel_err(forward(compiled, kw), expected["one"])
    out["graphs compiled at the first call"] = _dynamo.utils.counters["stats"]["unique_graphs"]
    _dynamo.utils.counters.clear()
    load_like_a_pipeline(pipe_cls, model, files["swap"], "default_0", hotswap=True)
    out["hotswap: same rank"] = rel_err(forward(compiled, kw), expected["swap"])
    model.load_lora_adapter(files["small"], adapter_name="default_0", hotswap=True)
    out["hotswap: smaller rank"] = rel_err(forward(compiled, kw), expected["small"])
    out["graphs compiled by the swaps"] = _dynamo.utils.counters["stats"]["unique_graphs"]
    out["recompilations by the swaps"] = sum(_dynamo.utils.counters["recompiles"].values())
    out["refuse: larger rank than prepared"] = refused(
        model, lambda: model.load_lora_adapter(files["big"], adapter_name="default_0", hotswap=True))
    out["hotswap: still the small adapter after the refusal"] = rel_err(forward(compiled, kw), expected["small"])

    # bad input: model unchanged, every rank raises
    model = sharded()
    model.load_lora_adapter(files["one"], adapter_name="one")
    other = "flux1" if family_name == "flux2" else "flux2"
    other_family = surgery.extend.families()[other]
    other_base = seeded_model(other_family, other_family.tests.configs[CASES[other][1]], 0)
    state, cfg = random_adapter(other_base, 9, 2, 2, block_linears(other_base))
    foreign = publish(pipe_cls, state, cfg, root / family_name / "foreign")
    out["refuse: another family"] = refused(model, lambda: model.load_lora_adapter(foreign, adapter_name="f"))
    wide_config = dict(config, attention_head_dim=config["attention_head_dim"] * 2)
    wide = seeded_model(family, wide_config, 0)
    state, cfg = random_adapter(wide, 9, 2, 2, block_linears(wide))
    wide_file = publish(pipe_cls, state, cfg, root / family_name / "wide")
    out["refuse: another width"] = refused(model, lambda: model.load_lora_adapter(wide_file, adapter_name="w"))
    state, cfg = random_adapter(base, 9, 2, 2, two_targets)
    state = {k.replace("single_transformer_blocks.0.", "single_transformer_blocks.99."): v for k, v in state.items()}
    missing = publish(pipe_cls, state, cfg, root / family_name / "missing")
    out["refuse: targets that do not exist"] = refused(model, lambda: model.load_lora_adapter(missing,
                                                                                              adapter_name="m"))
    corrupt = root / family_name / "corrupt"
    corrupt.mkdir()
    data = (files["two"] / "pytorch_lora_weights.safetensors").read_bytes()
    (corrupt / "pytorch_lora_weights.safetensors").write_bytes(data[: len(data) // 2] if mesh.get_local_rank() == 0
                                                               else data)
    out["refuse: corrupt file (on rank 0 only)"] = refused(model, lambda: model.load_lora_adapter(corrupt,
                                                                                                 adapter_name="c"))
    out["refuse: DoRA"] = refused(model, lambda: model.add_adapter(
        LoraConfig(r=2, lora_alpha=2, target_modules=two_targets, use_dora=True), adapter_name="d"))
    out["refusals left the adapter working"] = rel_err(forward(model, kw), expected["one"])
    return out


def run(rank: int, world: int, shared: str) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))  # PEFT sizes factors locally on named meshes
    root = Path(tempfile.mkdtemp(prefix=f"surgery-lora-tp-{rank}-"))
    try:
        return {family: check_family(family, mesh, root, Path(shared)) for family in CASES}
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from surgery.testing import run_on_cpu_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as shared:
        for r, result in enumerate(run_on_cpu_ranks(run, 2, shared)):
            for family, values in result.items():
                for key, value in values.items():
                    print(r, family, key, value)
