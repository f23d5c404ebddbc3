"""Train a LoRA on a FLUX transformer under tensor parallel x FSDP2 and save it as a stock diffusers adapter.

    # 4 CPU processes (gloo): TP 2 x FSDP2 2, a tiny seeded FLUX.2 model, a few steps
    torchrun --nproc-per-node 4 examples/train_lora_tp.py --device cpu --steps 3 --out lora_tp/

    # GPUs: same recipe, another device (for a published checkpoint, replace `base_model` with
    # surgery.load_tensor_parallel(Flux2Transformer2DModel, folder, mesh["tp"]): each rank reads only its slices)
    torchrun --nproc-per-node 8 examples/train_lora_tp.py --device cuda --tp 4 --steps 100 --out my_lora/

The recipe (torchtitan's order; no TP code in any forward):

    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    surgery.tensor_parallel(surgery.unfuse(model), mesh["tp"])      # or surgery.load_tensor_parallel(...)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16,              # stock names: the fused layers' parts
                                 target_modules=surgery.lora.lora_target_modules(model, ["to_qkv_mlp_proj", ...])))
    surgery.lora.shard_lora(model, mesh["tp"])                           # each factor laid out by its base's style
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ... train ...
    model.save_lora_adapter(folder)                                 # every rank; rank 0 writes the stock file

A tiny seeded model of `--family` (default flux2) is built on every rank from the same seed. The
saved `pytorch_lora_weights.safetensors` holds the adapter in the stock model's names (fused layers' factors joined
exactly), loadable by stock diffusers: `pipe.load_lora_weights(folder)` or `transformer.load_lora_adapter(folder,
prefix=None)`.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

BACKENDS = {"cuda": "nccl", "cpu": "gloo", "neuron": "neuron"}
# the stock layers to train, in the stock model's names (fused ones included); surgery.lora.lora_target_modules maps them
STOCK_TARGETS = {
    "flux2": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
              "linear_in", "linear_out", "to_qkv_mlp_proj", "attn.to_out"],
    "flux1": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
              "proj_mlp", "proj_out"],
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size; data parallel (FSDP2) is world / tp")
    parser.add_argument("--family", default="flux2", choices=sorted(STOCK_TARGETS))
    parser.add_argument("--config", default="tp_wide", help="the family's tiny test config (without --model)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=8)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--eps", type=float, default=1e-8, help="AdamW's eps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="global batch (split over the data-parallel ranks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="lora_tp", help="folder for the stock adapter file")
    return parser.parse_args(argv)


def base_model(args, device):
    """The stock (fused) transformer: a tiny seeded one, the same on every rank."""
    import surgery
    from surgery.testing import seeded_model

    family = surgery.extend.families()[args.family]
    dtype = getattr(torch, args.dtype)
    return seeded_model(family, family.tests.configs[args.config], args.seed, dtype).to(device), family


def batch(family, model_config: dict, args, step: int, dtype) -> tuple[dict, torch.Tensor]:
    """Seeded inputs and a regression target (the same on every rank; each data-parallel rank takes its share)."""
    from surgery.testing import example_inputs

    kw = example_inputs(family, model_config, batch=args.batch, seed=args.seed + 100 + step, dtype=dtype)
    hidden = kw["hidden_states"]
    target = torch.randn(hidden.shape[:-1] + (model_config.get("out_channels") or model_config["in_channels"],),
                         generator=torch.Generator().manual_seed(args.seed + 200 + step), dtype=dtype)
    return kw, target


def share(kw: dict, target: torch.Tensor, index: int, parts: int) -> tuple[dict, torch.Tensor]:
    """This data-parallel rank's share of the batch (position ids are shared)."""
    size = target.shape[0]
    out = {k: (v.chunk(parts)[index] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == size
               and not k.endswith("_ids") else v) for k, v in kw.items()}
    return out, target.chunk(parts)[index]


def make_optimizer(args, params):
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr, eps=args.eps, weight_decay=0.0)


def loss_of(model, kw, target):
    out = model(**kw, return_dict=False)[0]
    return ((out - target) ** 2).mean()


def add_lora(model, family_name: str, args):
    import surgery
    from peft import LoraConfig

    targets = surgery.lora.lora_target_modules(model, STOCK_TARGETS[family_name])
    # "gaussian": lora_B starts at zero (stock), lora_A random; every rank gets rank 0's draw from shard_lora
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=targets,
                                 init_lora_weights="gaussian"))
    return model


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it in the same order)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def train(args, mesh, base, family) -> dict:
    """TP x FSDP2 LoRA training on `mesh` ("dp", "tp"); returns the model, the initial and trained LoRA factors
    (whole) and each step's loss (this data-parallel rank's share of the batch)."""
    import surgery
    from torch.distributed.fsdp import fully_shard

    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(base)), mesh["tp"])
    add_lora(model, family.name, args)
    surgery.lora.shard_lora(model, mesh["tp"])  # src_data_rank=0: every TP rank gets rank 0's initial factors
    initial = {n: full(p).clone() for n, p in model.named_parameters() if "lora_" in n}
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.train()
    model.enable_gradient_checkpointing()
    optimizer = make_optimizer(args, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(args.steps):
        kw, target = batch(family, dict(base.config), args, step, base.dtype)
        kw, target = share(kw, target, dp_rank, dp)
        loss = loss_of(model, kw, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
    trained = {n: full(p).clone() for n, p in model.named_parameters() if "lora_" in n}
    return {"model": model, "initial": initial, "trained": trained, "losses": losses}


def train_one_device(args, base, family, initial: dict) -> dict:
    """The same steps on one device: the unfused model, the same adapter and initial factors, the whole batch."""
    import surgery

    model = add_lora(surgery.unfuse(copy.deepcopy(base)), family.name, args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(initial[name])
    model.train()
    model.enable_gradient_checkpointing()
    optimizer = make_optimizer(args, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(args.steps):
        kw, target = batch(family, dict(base.config), args, step, base.dtype)
        loss = loss_of(model, kw, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
    return {"model": model, "trained": {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n},
            "losses": losses}


def main(argv=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(BACKENDS[args.device], rank=rank, world_size=world)
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:{os.environ['LOCAL_RANK']}")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    base, family = base_model(args, device)
    result = train(args, mesh, base, family)
    result["model"].save_lora_adapter(args.out, adapter_name="default")
    if rank == 0:
        print(f"losses {[round(x, 6) for x in result['losses']]}; stock adapter written to "
              f"{os.path.join(args.out, 'pytorch_lora_weights.safetensors')}")
    dist.barrier()  # leave together: no rank closes its connections while a peer still runs a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
