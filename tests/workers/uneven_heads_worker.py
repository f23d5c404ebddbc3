"""What each gloo rank runs for tests/parallel/test_uneven_heads.py: heads the mesh does not divide, padded with
zero heads, against the single-device model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.core import heads_padding
from surgery.core.build import seeded_model
from surgery.core.registry import families
from surgery.testing import CollectiveCounter, rel_err

# family -> (config, heads the case holds); every other width divides the world
FLUX2 = dict(in_channels=16, timestep_guidance_channels=32, axes_dims_rope=(2, 2, 2, 2), attention_head_dim=8,
             num_layers=1, num_single_layers=2, joint_attention_dim=24, guidance_embeds=True)
SD3 = {**families()["sd3"].tests.configs["tiny_3.5"], "attention_head_dim": 12, "caption_projection_dim": 48}
CASES = {
    # 4 heads over 3 (-> 6); MLP 32 x 3 = 96 hidden units
    3: [("flux2", {**FLUX2, "num_attention_heads": 4, "mlp_ratio": 3.0}),
        ("sd3", {**SD3, "num_attention_heads": 4})],
    # 6 heads over 4 (-> 8) and over 5 (-> 10); MLP 48 x 2.5 = 120
    4: [("flux2", {**FLUX2, "num_attention_heads": 6, "mlp_ratio": 2.5})],
    5: [("flux2", {**FLUX2, "num_attention_heads": 6, "mlp_ratio": 2.5})],
}


def _forward(model, kw):
    return model(**kw, return_dict=False)[0]


def _inputs(name, config, seed):
    return families()[name].example_inputs(config, batch=2, seed=seed)


def _grads(model, name, config, seed):
    kw = _inputs(name, config, seed)
    kw["hidden_states"].requires_grad_(True)
    out = _forward(model, kw)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))).sum().backward()
    params = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return kw["hidden_states"].grad, params


def _padded_region(tensor, dim, real):
    return tensor.narrow(dim, real, tensor.shape[dim] - real)


def check_case(rank, world, mesh, name, config, folder) -> dict:
    family = families()[name]
    fused = seeded_model(family, config, 11)
    kw = _inputs(name, config, 11)
    result = {"heads": config["num_attention_heads"]}
    with torch.no_grad():
        expected = _forward(fused, kw)

    # refused by default, naming the option; the model untouched
    unfused = surgery.unfuse(copy.deepcopy(fused))
    before = {n: p.detach().clone() for n, p in unfused.state_dict().items()}
    try:
        surgery.tensor_parallel(unfused, mesh)
        result["refusal"] = None
    except surgery.SurgeryError as error:
        result["refusal"] = str(error)
    after = unfused.state_dict()
    result["unchanged_after_refusal"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before)

    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh, pad_heads=True)
    trims = heads_padding.trims(model)
    result["padded_heads"] = sorted({p.heads for _, _, ps in heads_padding.padded_blocks(model) for p in ps})
    result["padded_tensors"] = len(trims)
    with torch.no_grad(), CollectiveCounter() as ours:
        result["forward"] = rel_err(_forward(model, kw), expected)
    result["collectives"] = dict(ours.counts)
    # the same architecture with heads the mesh divides, sharded with no padding: the count to keep
    even = {**config, "num_attention_heads": result["padded_heads"][0][1]}
    if name == "sd3":
        even["caption_projection_dim"] = even["num_attention_heads"] * even["attention_head_dim"]
    reference = surgery.tensor_parallel(surgery.unfuse(seeded_model(family, even, 11)), mesh)
    with torch.no_grad(), CollectiveCounter() as theirs:
        _forward(reference, _inputs(name, even, 11))
    result["even_collectives"] = dict(theirs.counts)

    # backward: every gradient against the single-device unfused model (the zero heads' cut off), theirs zero
    ref_input, ref = _grads(surgery.unfuse(copy.deepcopy(fused)), name, config, 12)
    tp_input, tp = _grads(model, name, config, 12)
    result["grad_input"] = rel_err(tp_input, ref_input)
    errors, padded_grad = [], 0.0
    for n, g in ref.items():
        if g is None:
            continue
        got = tp[n]
        if n in trims:
            dim, real = trims[n]
            padded_grad = max(padded_grad, _padded_region(got, dim, real).abs().max().item())
            got = got.narrow(dim, 0, real)
        errors.append(rel_err(got, g))
    result["grad_params"] = max(errors)
    result["padded_grad_max"] = padded_grad

    # an optimizer step (AdamW with weight decay, then SGD): the zero rows stay exactly zero
    params = dict(model.named_parameters())
    for optimizer in (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                      torch.optim.SGD(model.parameters(), lr=1e-2)):
        optimizer.step()
    result["padded_after_step_max"] = max(
        _padded_region(params[n].full_tensor(), dim, real).abs().max().item() for n, (dim, real) in trims.items())
    model.zero_grad(set_to_none=True)

    # save -> stock from_pretrained: the original model, bitwise
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh, pad_heads=True)
    surgery.save_pretrained(model, folder)
    if rank == 0:
        loaded = type(fused).from_pretrained(folder)
        theirs_sd, ours_sd = fused.state_dict(), loaded.state_dict()
        result["saved_keys_equal"] = theirs_sd.keys() == ours_sd.keys()
        result["saved_mismatch"] = sorted(k for k in theirs_sd if k in ours_sd and (
            theirs_sd[k].shape != ours_sd[k].shape or not torch.equal(theirs_sd[k], ours_sd[k])))
    return result


# the double-stream attention's projections: rows (q/k/v) and columns (outputs) that meet zero heads
LORA_ROWS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
LORA_COLUMNS = ("to_out.0", "to_add_out")


def _lora_padded(model, real: int) -> dict[str, tuple[int, torch.Tensor]]:
    """Each factor's part that meets a zero head, read off the names and the real width (not the padding records):
    lora_B's rows past `real` of a q/k/v, lora_A's columns past `real` of an output projection."""
    out = {}
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if ".lora_B." in n and any(f".{r}.lora_B." in n for r in LORA_ROWS):
            out[n] = full[real:]
        elif ".lora_A." in n and any(f".{c}.lora_A." in n for c in LORA_COLUMNS):
            out[n] = full[:, real:]
    return out


def check_lora(rank, mesh, name, config, folder) -> dict:
    """An adapter trained on the padded sharded model: zero where it meets zero heads, before and after a step;
    saved as the stock adapter that stock diffusers loads with the same outputs; loaded back onto a padded model."""
    from peft import LoraConfig

    family = families()[name]
    fused = seeded_model(family, config, 21)
    kw = _inputs(name, config, 21)
    real = config["num_attention_heads"] * config["attention_head_dim"]
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh, pad_heads=True)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=[*LORA_ROWS, *LORA_COLUMNS]), adapter_name="x")
    surgery.lora.shard_lora(model)
    result = {"after_shard_lora": max(t.abs().max().item() for t in _lora_padded(model, real).values())}
    # trained-looking factors: random where they meet real heads, the same on every rank
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                full = torch.randn(p.shape, generator=generator) * 0.3
                p.copy_(_placed(full, p))
        padded = _lora_padded(model, real)
        for n, p in model.named_parameters():
            if n in padded:
                mask = torch.ones(p.shape)
                (mask[real:] if ".lora_B." in n else mask[:, real:]).zero_()
                p.mul_(_placed(mask, p))
    # one training step on the adapter alone: the zero parts stay zero
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    out = _forward(model, kw)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(6))).sum().backward()
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1).step()
    result["after_step"] = max(t.abs().max().item() for t in _lora_padded(model, real).values())
    with torch.no_grad():
        ours = _forward(model, kw)
    model.save_lora_adapter(folder, adapter_name="x")
    dist.barrier()
    stock = copy.deepcopy(fused)
    stock.load_lora_adapter(folder, prefix=None, adapter_name="x", weight_name="pytorch_lora_weights.safetensors")
    with torch.no_grad():
        expected = _forward(stock, kw)
    result["saved -> stock"] = rel_err(ours, expected)
    again = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh, pad_heads=True)
    again.load_lora_adapter(folder, prefix=None, adapter_name="x", weight_name="pytorch_lora_weights.safetensors")
    with torch.no_grad():
        result["stock -> padded load"] = rel_err(_forward(again, kw), expected)
    return result


def _placed(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` (a DTensor's placements: this rank's chunk), or itself."""
    if not isinstance(like, DTensor):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def run(rank: int, world: int, folder: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i, (name, config) in enumerate(CASES[world]):
        out[name] = check_case(rank, world, mesh, name, config, f"{folder}/{name}-{i}")
        dist.barrier()
    if world == 3:
        out["lora"] = check_lora(rank, mesh, "flux2", CASES[3][0][1], f"{folder}/lora")
    return out
