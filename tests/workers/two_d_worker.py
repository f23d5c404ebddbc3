"""What each of 4 gloo ranks runs for the 2-D mesh tests (TP x CP inference, TP x FSDP2 training, refusals).

The TP x FSDP2 recipe is torchtitan's order and needs no surgery function: FSDP2's `fully_shard` takes parameters
that are already DTensors on the "tp" dimension and shards them again over "dp".

    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    surgery.tensor_parallel(surgery.unfuse(model), mesh["tp"])
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for block in blocks:
            fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import surgery
from surgery.testing import CollectiveCounter
from surgery.parallel.context_parallel import attention_processors
from flux2_testing import assert_unchanged, build, inputs, rel_err, small_config, snapshot, use_kv_processors


def cp_inputs(config, seed, batch=2, image_tokens=16, text_tokens=8):
    """Inputs as the pipelines pass them: ids with a batch dimension, which the model's `_cp_plan` splits."""
    kw = inputs(config, seed, batch=batch, image_tokens=image_tokens, text_tokens=text_tokens)
    kw["img_ids"], kw["txt_ids"] = kw["img_ids"].unsqueeze(0), kw["txt_ids"].unsqueeze(0)
    return kw


def _forward(model, kw):
    return model(**kw, return_dict=False)[0]


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# --- TP x CP inference -----------------------------------------------------------------------------------------------


def check_tp_cp(mesh) -> dict:
    """TP2 x CP2 (Ulysses) and CP4 alone (on the stock fused model) against the single-device fused model."""
    config = small_config("tp_wide")
    fused = build(config, 0)
    kw = cp_inputs(config, 0)
    result = {}
    with torch.no_grad():
        expected = _forward(fused, kw)
        model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh["tp"])
        surgery.context_parallel(model, mesh["cp"], ulysses_degree=2)
        with CollectiveCounter() as counter:
            result["tp2_cp2"] = rel_err(_forward(model, kw), expected)
        result["tp2_cp2_collectives"] = dict(counter.counts)

        alone = surgery.context_parallel(copy.deepcopy(fused), init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)))
        with CollectiveCounter() as counter:
            result["cp4"] = rel_err(_forward(alone, kw), expected)
        result["cp4_collectives"] = dict(counter.counts)
    result["calls"] = check_call_refusals(model, config)
    return result


def check_call_refusals(model, config) -> dict:
    """What the call-time guard refuses on a context-parallel model: KV-cache modes, a dataclass output, 2-D ids."""
    out = {}
    use_kv_processors(model)
    extract = cp_inputs(config, 7)
    calls = {
        "kv_extract": lambda: model(**extract, kv_cache_mode="extract", num_ref_tokens=4, return_dict=False),
        "return_dict": lambda: model(**cp_inputs(config, 7)),
        "flat_ids": lambda: model(**inputs(config, 7, image_tokens=16), return_dict=False),
    }
    with torch.no_grad():
        for key, call in calls.items():
            try:
                call()
                out[key] = None
            except surgery.SurgeryError as error:
                out[key] = str(error)
    return out


# --- TP x FSDP2 training ---------------------------------------------------------------------------------------------


def fully_shard_blocks(model, dp_mesh):
    """torchtitan's `apply_fsdp` order: each transformer block, then the root."""
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _loss(model, kw, target):
    return ((_forward(model, kw) - target) ** 2).mean()


def _batch_slice(kw, index, parts):
    """This data-parallel rank's share of the batch (ids are shared)."""
    out = {}
    for key, value in kw.items():
        if isinstance(value, torch.Tensor) and key not in ("img_ids", "txt_ids"):
            value = value.chunk(parts)[index]
        out[key] = value
    return out


def train_step(model, kw, target, optimizer_cls, **optimizer_kw):
    model.train()
    model.enable_gradient_checkpointing()
    optimizer = optimizer_cls(model.parameters(), **optimizer_kw)
    loss = _loss(model, kw, target)
    loss.backward()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return grads, params


def check_training(mesh) -> dict:
    """TP2 x FSDP2 (dp 2): one step with gradient checkpointing on, against the same step on one device."""
    config = small_config("tp_wide")
    base = surgery.unfuse(build(config, 3))
    kw = inputs(config, 3, batch=2, image_tokens=16)
    target = torch.randn(2, 16, config["in_channels"], generator=torch.Generator().manual_seed(4))
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    local_kw, local_target = _batch_slice(kw, dp_rank, dp), target.chunk(dp)[dp_rank]
    result = {}
    for name, cls, opts in (("sgd", torch.optim.SGD, {"lr": 0.1}), ("adamw", torch.optim.AdamW, {"lr": 1.0, "eps": 1.0})):
        ref_grads, ref_params = train_step(copy.deepcopy(base), kw, target, cls, **opts)
        model = surgery.tensor_parallel(copy.deepcopy(base), mesh["tp"])
        fully_shard_blocks(model, mesh["dp"])
        grads, params = train_step(model, local_kw, local_target, cls, **opts)
        assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
        result[name] = {
            "grads": max(rel_err(grads[n], g) for n, g in ref_grads.items()),
            "params": max(rel_err(params[n], p) for n, p in ref_params.items()),
            "max_abs_param_diff": max((params[n] - p).abs().max().item() for n, p in ref_params.items()),
            "changed": max((p - base.get_parameter(n).detach()).abs().max().item() for n, p in ref_params.items()),
            "placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}),
        }
    return result


# --- LoRA (PEFT) on TP x FSDP2 ---------------------------------------------------------------------------------------

# every kind of sharded Linear of the first double and single block: column-sharded, row-sharded and all-reduced,
# row-sharded with a partial output that joins the single block's one all-reduce
LORA_TARGETS = (r"(transformer_blocks\.0\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|"
                r"ff\.(linear_in\.(gate|up)|linear_out))|"
                r"single_transformer_blocks\.0\.attn\.(to_qkv_mlp_proj\.(q|k|v|gate|up)|to_out\.(attn_part|mlp_part)))")
# the double block's 8 attention and 3 feed-forward Linears, the single block's 5 row and 2 column leaves
LORA_TARGET_COUNT = 18


def lora_factors(model, rank: int = 2, seed: int = 5) -> dict:
    """Seeded full-size factors `{path: (A [r, in], B [out, r])}` for every Linear LORA_TARGETS names (B nonzero, as
    after some training, so that both factors get gradients)."""
    import re

    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for path, module in model.named_modules():
        if re.fullmatch(LORA_TARGETS, path) and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=generator) * 0.1
            factors[path] = (a, torch.randn(module.out_features, rank, generator=generator) * 0.1)
    return factors


def add_lora(model, factors: dict):
    """PEFT LoRA adapters on the Linears `factors` names, base weights frozen, then the factors' values."""
    from peft import LoraConfig, inject_adapter_in_model

    rank = next(iter(factors.values()))[0].shape[0]
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(factors)), model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def set_lora_local(model, factors: dict, mesh):
    """`set_lora` for factors PEFT sized to the local shard of a sharded base: each rank copies its rows/columns."""
    rank, world = mesh.get_local_rank(), mesh.size()
    with torch.no_grad():
        for path, full in factors.items():
            layer = model.get_submodule(path)
            for factor, value in zip((layer.lora_A["default"].weight, layer.lora_B["default"].weight), full):
                for dim in (0, 1):
                    if factor.shape[dim] != value.shape[dim]:
                        value = value.chunk(world, dim)[rank]
                factor.copy_(value)
    return model


def set_lora(model, factors: dict):
    with torch.no_grad():
        for path, (a, b) in factors.items():
            layer = model.get_submodule(path)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
    return model


def check_lora(mesh) -> dict:
    """LoRA on the unfused Linears of a TP2 x FSDP2 model: one SGD step (gradient checkpointing on) vs one device."""
    config = small_config("tp_wide")
    base = surgery.unfuse(build(config, 3))
    kw = inputs(config, 3, batch=2, image_tokens=16)
    target = torch.randn(2, 16, config["in_channels"], generator=torch.Generator().manual_seed(4))
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    factors = lora_factors(base)

    reference = set_lora(add_lora(copy.deepcopy(base), factors), factors)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_grads, ref_params = train_step(reference, kw, target, torch.optim.SGD, lr=0.1)

    # PEFT sizes the factors to the base weights' local shards here (their mesh has dim names): set_lora_local gives
    # each rank its shards of the same full-size factors; surgery.lora.shard_lora lays them out (no broadcast)
    model = set_lora_local(add_lora(surgery.tensor_parallel(copy.deepcopy(base), mesh["tp"]), factors), factors,
                           mesh["tp"])
    surgery.lora.shard_lora(model, mesh["tp"], src_data_rank=None)
    fully_shard_blocks(model, mesh["dp"])
    grads, params = train_step(model, _batch_slice(kw, dp_rank, dp), target.chunk(dp)[dp_rank], torch.optim.SGD, lr=0.1)
    frozen = [n for n in params if "lora_" not in n]
    return {
        "adapters": len(factors),
        "targets": sorted(factors),
        "trainable": sorted(grads) == sorted(ref_grads) and all("lora_" in n for n in grads),
        "grads": max(rel_err(grads[n], g) for n, g in ref_grads.items()),
        "params": max(rel_err(params[n], p) for n, p in ref_params.items()),
        "frozen_unchanged": all(torch.equal(params[n], ref_params[n]) for n in frozen),
        "changed": max((ref_params[n] - initial[n]).abs().max().item() for n in ref_grads),
        "lora_placements": sorted({str(p.placements) for n, p in model.named_parameters() if "lora_" in n}),
    }


# --- refusals --------------------------------------------------------------------------------------------------------


def _untouched(model, snap) -> None:
    assert_unchanged(model, snap)
    assert getattr(model, "_diffusers_hook", None) is None
    assert getattr(model, "_parallel_config", None) is None
    for _, _, processor in attention_processors(model):
        assert processor._parallel_config is None


def _untouched_locally(model, snap) -> None:
    """`_untouched` without collectives (comparing DTensors would run some, and here the ranks' models differ)."""
    modules, params = snap
    assert [(name, id(m), type(m)) for name, m in model.named_modules()] == modules
    for name, param in model.named_parameters():
        assert id(param) == params[name][0] and torch.equal(_local(param.detach()), params[name][1]), name
    assert getattr(model, "_diffusers_hook", None) is None and getattr(model, "_parallel_config", None) is None


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_snapshot(model) -> tuple:
    modules = [(name, id(m), type(m)) for name, m in model.named_modules()]
    return modules, {name: (id(p), _local(p.detach()).clone()) for name, p in model.named_parameters()}


def refusal(fn, model, check=_untouched) -> str | None:
    snap = _local_snapshot(model) if check is _untouched_locally else snapshot(model)
    try:
        fn(model)
    except surgery.SurgeryError as error:
        check(model, snap)
        return str(error)
    return None


def check_refusals(mesh) -> dict:
    out = {}
    cp = lambda m, **kw: surgery.context_parallel(m, mesh["cp"], **kw)  # noqa: E731
    # dev_small: 6 heads; TP 2 leaves 3 per rank, which Ulysses 2 cannot split
    six = small_config("dev_small")
    out["local_heads"] = refusal(cp, surgery.tensor_parallel(surgery.unfuse(build(six)), mesh["tp"]))
    # only the first CP rank's models are refused (ranks 0 and 1, one TP group, which must hold the same model to
    # pass tensor_parallel's own agreement): every rank refuses together, before any group is built
    mine = six if mesh["cp"].get_local_rank() == 0 else small_config("tp_wide")
    out["one_rank"] = refusal(cp, surgery.tensor_parallel(surgery.unfuse(build(mine)), mesh["tp"], src_data_rank=None),
                              check=_untouched_locally)

    grid3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    model = surgery.tensor_parallel(surgery.unfuse(build(small_config("tp_wide"))), grid3["tp"])
    out["mesh_3d"] = refusal(lambda m: surgery.context_parallel(m, grid3), model)
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out["no_cp_dim"] = refusal(lambda m: surgery.context_parallel(m, dp_tp), model)
    out["whole_2d"] = refusal(lambda m: surgery.context_parallel(m, mesh), model)
    out["tp_mesh_as_cp"] = refusal(lambda m: surgery.context_parallel(m, mesh["tp"]), model)
    out["ring_on_cpu"] = refusal(lambda m: cp(m, ring_degree=2, ulysses_degree=1), model)
    out["degrees"] = refusal(lambda m: cp(m, ulysses_degree=4), model)

    # the wrong order: context parallelism first, then tensor parallelism refuses and changes nothing
    first = surgery.context_parallel(surgery.unfuse(build(small_config("tp_wide"))), mesh["cp"])
    out["wrong_order"] = refusal(lambda m: surgery.tensor_parallel(m, mesh["tp"]), first, check=assert_unchanged)
    out["twice"] = refusal(lambda m: cp(m), first, check=assert_unchanged)
    return out


def run(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "tp_cp": check_tp_cp(mesh),
        "training": check_training(dp_tp),
        "lora": check_lora(dp_tp),
        "refusals": check_refusals(mesh),
    }
