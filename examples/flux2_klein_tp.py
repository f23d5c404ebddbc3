"""FLUX.2-klein with tensor parallelism: unfuse the transformer, shard it with stock torch TP, generate one image.

    torchrun --nproc-per-node 4 examples/flux2_klein_tp.py --device cuda \
        --model black-forest-labs/FLUX.2-klein-9B --prompt "a red fox in fresh snow" --steps 4

    # Trainium / Inferentia (native TorchNeuron: the `neuron` device and process-group backend)
    torchrun --nproc-per-node 8 examples/flux2_klein_tp.py --device neuron --model black-forest-labs/FLUX.2-klein-9B

    # CPU, gloo (slow; for checking the plumbing)
    torchrun --nproc-per-node 2 examples/flux2_klein_tp.py --device cpu --steps 1 --height 256 --width 256

    # 2-D: tensor parallel 4 x context parallel 2 (diffusers' Ulysses attention splits the sequence over "cp")
    torchrun --nproc-per-node 8 examples/flux2_klein_tp.py --device cuda --cp 2 --height 2048 --width 2048

Each rank reads only its own slices of the transformer's safetensors (`surgery.load_tensor_parallel`): no rank ever
holds the whole transformer, and no weight collective runs. `--full-load` instead loads the whole pipeline on every
rank's host and shards it with `surgery.unfuse` + `surgery.tensor_parallel(..., src_data_rank=None)`. The text
encoder and VAE are replicated. Rank 0 saves the image.

`--cp N` lays the ranks out as a `("cp", "tp")` mesh of N x world/N: the transformer is sharded over "tp" as above,
then `surgery.context_parallel(transformer, mesh["cp"])` splits the image and text tokens over "cp" with diffusers'
Ulysses attention (the heads each TP rank holds must divide by N).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

BACKENDS = {"cuda": "nccl", "neuron": "neuron", "cpu": "gloo"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cuda")
    parser.add_argument("--model", default="black-forest-labs/FLUX.2-klein-4B", help="hub id or local pipeline dir")
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dusk, oil painting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--out", default="flux2_klein_tp.png")
    parser.add_argument("--full-load", action="store_true", help="load everything on each host, then shard")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel (Ulysses) size; TP is world / cp")
    return parser.parse_args()


def setup(device_type: str) -> tuple[int, int, torch.device]:
    if device_type == "neuron":
        import torch_neuronx  # noqa: F401  registers the "neuron" device and process-group backend

    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    dist.init_process_group(BACKENDS[device_type], rank=rank, world_size=world)
    if device_type == "cpu":
        return rank, world, torch.device("cpu")
    getattr(torch, device_type).set_device(local_rank)
    return rank, world, torch.device(device_type, local_rank)


def quiet(rank: int) -> None:
    """One progress bar per job: rank 0's (loading and denoising); the other ranks run the same steps silently."""
    import diffusers
    import transformers

    if rank != 0:
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()


def main() -> None:
    args = parse_args()
    rank, world, device = setup(args.device)
    quiet(rank)

    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
    from huggingface_hub import snapshot_download
    from torch.distributed.device_mesh import init_device_mesh

    import surgery

    dtype = getattr(torch, args.dtype)
    if args.cp < 1 or world % args.cp:
        raise SystemExit(f"--cp {args.cp} does not divide the {world} ranks")
    mesh = init_device_mesh(args.device, (args.cp, world // args.cp), mesh_dim_names=("cp", "tp"))

    if rank == 0 and not os.path.isdir(args.model):
        snapshot_download(args.model)  # once, into the local cache every rank then reads from
    dist.barrier()
    folder = args.model if os.path.isdir(args.model) else snapshot_download(args.model, local_files_only=True)

    started = time.perf_counter()
    if args.full_load:
        pipe = Flux2KleinPipeline.from_pretrained(folder, dtype=dtype)  # on the host
        surgery.unfuse(pipe.transformer)
        surgery.tensor_parallel(pipe.transformer, mesh["tp"], src_data_rank=None)  # moves only shards to `device`
    else:
        transformer = surgery.load_tensor_parallel(Flux2Transformer2DModel, folder, mesh["tp"], dtype=dtype)
        pipe = Flux2KleinPipeline.from_pretrained(folder, transformer=transformer, dtype=dtype)
    if args.cp > 1:
        surgery.context_parallel(pipe.transformer, mesh["cp"])  # after tensor_parallel: Ulysses splits local heads
    pipe.to(device)
    if rank == 0:
        layout = f"cp {args.cp} x tp {world // args.cp}" if args.cp > 1 else f"tp {world}"
        print(f"loaded, unfused and sharded over {world} {args.device} ranks ({layout}) in "
              f"{time.perf_counter() - started:.1f}s")

    pipe.set_progress_bar_config(disable=rank != 0)  # the denoising steps: one bar, rank 0's
    generator = torch.Generator("cpu").manual_seed(args.seed)  # same noise on every rank
    started = time.perf_counter()
    image = pipe(
        prompt=args.prompt,
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        generator=generator,
    ).images[0]
    if rank == 0:
        image.save(args.out)
        print(f"{args.steps} steps in {time.perf_counter() - started:.1f}s -> {args.out}")
    dist.barrier()  # leave together: no rank closes its connections while a peer still runs a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
