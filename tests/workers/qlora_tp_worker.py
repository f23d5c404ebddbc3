"""What each gloo rank runs for tests/integration/test_qlora_tp.py: LoRA adapters (peft, loaded the diffusers way) on a FLUX.2
model that is unfused, quantized by torchao and sharded by `tensor_parallel`, against the same quantized model with
the same adapters run whole on one process (QLoRA-style: the base frozen and quantized, the adapter trained)."""

from __future__ import annotations

import copy
import traceback
import warnings
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

warnings.filterwarnings("ignore")

import surgery  # noqa: E402
from surgery.testing import example_inputs, rel_err, seeded_model  # noqa: E402
from lora_tp_worker import block_linears, forward, pipeline_class, publish, random_adapter  # noqa: E402


def quantized(model):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())
    return model


def run(rank: int, world: int, shared: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    family = surgery.extend.families()["flux2"]
    pipe_cls = pipeline_class("Flux2Pipeline")
    config = family.tests.configs["dev_small"]
    base = seeded_model(family, config, 0)
    kw = example_inputs(family, config, batch=1, seed=0)
    targets = block_linears(base)
    files = {}
    for name, seed, r, alpha, tg in (("one", 1, 4, 8, targets),
                                     ("two", 2, 2, 2, [t for t in targets if t.startswith("single_")])):
        state, cfg = random_adapter(base, seed, r, alpha, tg)
        files[name] = publish(pipe_cls, state, cfg, Path(shared) / f"rank{rank}" / name)

    def build(sharded: bool):
        model = quantized(surgery.unfuse(copy.deepcopy(base)))
        if sharded:
            surgery.tensor_parallel(model, mesh)
        for name, folder in files.items():
            model.load_lora_adapter(folder, adapter_name=name, weight_name="pytorch_lora_weights.safetensors")
        return model

    out = {}
    try:
        whole, model = build(False), build(True)
    except Exception:  # noqa: BLE001 - the traceback is the result
        return {"error": traceback.format_exc()[-2000:]}
    out["quantized shards"] = sum(type(p).__name__ == "Int8Tensor" and isinstance(getattr(p, "qdata"), DTensor)
                                  for p in model.parameters())
    for label, names, weights in (("one", ["one"], None), ("two", ["two"], None),
                                  ("one+two", ["one", "two"], [0.7, -0.4])):
        whole.set_adapters(names, weights)
        model.set_adapters(names, weights)
        out[f"load and switch: {label}"] = rel_err(forward(model, kw), forward(whole, kw))

    # training adapter "one" alone: the gradients of its factors (the base stays frozen and quantized)
    whole.set_adapters(["one"])
    model.set_adapters(["one"])
    grads = []
    for m in (whole, model):
        for name, p in m.named_parameters():
            p.requires_grad_(".one." in name and "lora_" in name)
        loss = m(**kw, return_dict=False)[0].square().mean()
        (loss.full_tensor() if isinstance(loss, DTensor) else loss).backward()
        grads.append({n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for n, p in m.named_parameters() if p.requires_grad})
    out["trained factors"] = (len(grads[0]), len(grads[1]))
    out["train: gradients"] = max(rel_err(grads[1][n], g) for n, g in grads[0].items())
    return out
