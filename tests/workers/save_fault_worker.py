"""What each gloo rank runs for the TP save fault tests: every case in sequence, in one spawned job (world 2).

Each case records, per rank, the error raised (type and message), the seconds it took to arrive, the files under the
case's folder afterwards and any temporary or lock file left beside it. The handshake timeout is 3 s and the process
group's 60 s, so a rank left waiting fails its case instead of hanging the suite.
"""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import signal
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from diffusers import Flux2Transformer2DModel
from torch.distributed.device_mesh import init_device_mesh

import surgery
from flux2_testing import build, small_config
from surgery.io import safetensors_writer

HANDSHAKE_S = 3
CONFIG = small_config("tp_wide")


def tree(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        out[name] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return out


def attempt(call) -> dict:
    start = time.monotonic()
    try:
        call()
        error = None
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt is one of the expected answers
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - start}


def fail_on(rank: int, on_rank: int, error: BaseException):
    """torch's distributed checkpoint writer raises `error` on one rank only (a full disk, Ctrl-C)."""
    original = HuggingFaceStorageWriter.write_data

    def write_data(self, *args, **kwargs):
        if rank == on_rank:
            raise error
        return original(self, *args, **kwargs)

    return mock.patch.object(HuggingFaceStorageWriter, "write_data", write_data)


def run(rank: int, world: int, root: str) -> dict:
    os.environ["SURGERY_HANDSHAKE_TIMEOUT"] = str(HANDSHAKE_S)
    try:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=60), None)
    except Exception:  # noqa: BLE001 - only a guard against a hang; the cases do not need it
        pass
    root = Path(root)
    mesh = init_device_mesh("cpu", (world,))
    model = surgery.tensor_parallel(surgery.unfuse(build(CONFIG, 0)), mesh, src_data_rank=None)
    out: dict[str, dict] = {}

    def case(name: str, call, folder: Path, mine: Path | None = None) -> None:
        """`folder`: the destination rank 0 checks for changes; `mine`: where this rank wrote (default `folder`),
        checked on every rank for temporary or lock files left behind."""
        dist.barrier()
        before = tree(folder.parent) if rank == 0 else {}
        result = attempt(call)
        dist.barrier()
        if rank == 0:
            result["changed"] = tree(folder.parent) != before
        own = (mine or folder).parent
        result["leftovers"] = sorted(p.name for p in own.glob("*") if ".surgery-" in p.name)
        out[name] = result

    # files the save does not own are kept; an older sharded checkpoint there is replaced whole
    keep = root / "keep" / "model"
    if rank == 0:
        build(CONFIG, 1).save_pretrained(keep, max_shard_size="20KB")
        (keep / "README.md").write_text("mine")
        (keep / "pytorch_lora_weights.safetensors").write_bytes(b"lora")
        (keep / "samples").mkdir()
        (keep / "samples" / "a.png").write_bytes(b"png")
    dist.barrier()
    out["keep"] = attempt(lambda: surgery.save_pretrained(model, keep, max_shard_size="40KB"))
    if rank == 0:
        out["keep"]["files"] = sorted(str(p.relative_to(keep)) for p in keep.rglob("*"))
        fused = build(CONFIG, 0)
        fused.save_pretrained(root / "keep" / "stock", max_shard_size="40KB")
        out["keep"]["stock_files"] = sorted(p.name for p in (root / "keep" / "stock").iterdir())

    # a pipeline's root folder
    pipe = root / "pipe" / "pipeline"
    if rank == 0:
        (pipe / "vae").mkdir(parents=True)
        (pipe / "vae" / "config.json").write_text("{}")
        (pipe / "model_index.json").write_text('{"_class_name": "Flux2Pipeline"}')
    case("pipeline_root", lambda: surgery.save_pretrained(model, pipe), pipe)

    # rank 1's destination is a file, rank 0's a folder (it raised before the exchange, leaving rank 0 waiting)
    base = root / "file"
    if rank == 0:
        base.mkdir()
        (base / "a-file").write_text("not a folder")
    case("file_on_one_rank", lambda: surgery.save_pretrained(model, base / ("a-file" if rank else "model")),
         base / "model")

    # different folders per rank: same parent, then different parents
    base = root / "different"
    case("different_names", lambda: surgery.save_pretrained(model, base / f"model{rank}"), base / "model0")
    case("different_parents", lambda: surgery.save_pretrained(model, root / f"elsewhere{rank}" / "model"),
         root / "elsewhere0" / "model", root / f"elsewhere{rank}" / "model")

    # failures inside the write: one rank's disk is full; one rank gets Ctrl-C; rank 0 fails in its own pass
    base = root / "faults" / "model"
    if rank == 0:
        build(CONFIG, 2).save_pretrained(base)
    with fail_on(rank, 1, OSError(errno.ENOSPC, "No space left on device", "/disk/x")):
        case("disk_full_rank_1", lambda: surgery.save_pretrained(model, base), base)
    with fail_on(rank, 1, KeyboardInterrupt()):
        case("interrupt_rank_1", lambda: surgery.save_pretrained(model, base), base)
    original = safetensors_writer.write_file

    def failing(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large", str(args[0]))

    with mock.patch.object(safetensors_writer, "write_file", failing if rank == 0 else original):
        case("write_fails_rank_0", lambda: surgery.save_pretrained(model, base), base)

    # called on rank 0 only: rank 0 raises within the handshake timeout, naming rank 1; then both save fine
    alone = root / "alone" / "model"
    case("rank_0_only", lambda: surgery.save_pretrained(model, alone) if rank == 0 else None, alone)
    case("both_after", lambda: surgery.save_pretrained(model, alone), alone)
    if rank == 0:
        out["both_after"]["written"] = sorted(p.name for p in alone.iterdir())

    # the other collective verbs: called on rank 0 only, rank 0 raises within the handshake timeout naming rank 1;
    # then both call it and it works
    fresh = surgery.unfuse(build(CONFIG, 0))
    where = root / "tp" / "none"
    case("tp_rank_0_only", lambda: surgery.tensor_parallel(fresh, mesh) if rank == 0 else None, where)
    case("tp_both_after", lambda: surgery.tensor_parallel(fresh, mesh), where)
    out["tp_both_after"]["sharded"] = type(fresh.transformer_blocks[0].attn.to_q.weight).__name__

    # the same for a sharded load and for context parallelism (the mesh is built on both ranks first)
    checkpoint = root / "ckpt" / "model"
    if rank == 0:
        build(CONFIG, 0).save_pretrained(checkpoint)
    dist.barrier()
    load = lambda: surgery.load_tensor_parallel(Flux2Transformer2DModel, checkpoint, mesh)  # noqa: E731
    case("load_rank_0_only", lambda: load() if rank == 0 else None, where)
    case("load_both_after", load, where)
    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    plain = build(CONFIG, 0)
    case("cp_rank_0_only", lambda: surgery.context_parallel(plain, cp_mesh) if rank == 0 else None, where)
    case("cp_both_after", lambda: surgery.context_parallel(plain, cp_mesh), where)

    # LoRA adapters on the sharded model: saved and loaded by every rank (rank 0 writes)
    from peft import LoraConfig
    from surgery.integration import lora_tp

    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_out.0", "to_qkv_mlp_proj"],
                                 init_lora_weights=False), adapter_name="x")
    lora_tp.shard_lora(model)
    lora = root / "lora" / "adapter"
    case("lora_rank_0_only", lambda: model.save_lora_adapter(lora, adapter_name="x") if rank == 0 else None, lora)
    case("lora_both_after", lambda: model.save_lora_adapter(lora, adapter_name="x"), lora)
    case("lora_different_folders", lambda: model.save_lora_adapter(root / "lora" / f"a{rank}", adapter_name="x"),
         root / "lora" / "a0", root / "lora" / f"a{rank}")
    case("lora_different_names", lambda: model.load_lora_adapter(lora, adapter_name=f"y{rank}"), lora)
    case("lora_save_no_such_adapter_on_rank_1",
         lambda: model.save_lora_adapter(lora, adapter_name="x" if rank == 0 else "nope"), lora)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_out.0", "to_qkv_mlp_proj"],
                                 init_lora_weights=False), adapter_name="z")
    lora_tp.shard_lora(model)
    case("lora_save_different_adapters", lambda: model.save_lora_adapter(lora, adapter_name="xz"[rank]), lora)
    model.delete_adapters("z")
    out["lora_different_names"]["adapters"] = sorted(model.peft_config)
    original_write = lora_tp.write_adapter

    def write_on_a_full_disk(*args, **kwargs):
        # the kernel's own refusal (EFBIG, as a full disk gives ENOSPC), for this write only: the store that the
        # process group uses is a file too
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
        try:
            return original_write(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)

    with mock.patch.object(lora_tp, "write_adapter", write_on_a_full_disk if rank == 0 else original_write):
        case("lora_disk_full_rank_0", lambda: model.save_lora_adapter(lora, adapter_name="x"), lora)
    return out
