"""What each gloo rank runs for the rank-agreement tests: every case in sequence, in one spawned job.

Each case gives one rank a different (or bad) input, calls the verb on every rank and records the error each rank
raised, how long it took to arrive, and whether the model is exactly as it was. The cases run on a process group with
a short timeout, so a rank left waiting in a collective fails the case within seconds instead of hanging the suite.
"""

from __future__ import annotations

import sys
import tempfile
import time
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import surgery
from surgery.parallel.agreement import agree
from surgery.testing import CollectiveCounter
from flux2_testing import assert_unchanged, build, inputs, rel_err, small_config, snapshot

TIMEOUT_S = 30  # the cases' process group: a hang would surface as an error after this, never as a stuck suite
CONFIG = small_config("tp_wide")


def unfused(config=CONFIG, seed=0, dtype=torch.float32):
    return surgery.unfuse(build(config, seed, dtype))


def leftovers(model) -> list[str]:
    """Hooks or attributes that `parallelize_module` leaves behind on a module, by module path."""
    out = []
    for path, module in model.named_modules():
        for name in ("_forward_hooks", "_forward_pre_hooks"):
            if getattr(module, name):
                out.append(f"{path}.{name}")
        if getattr(module, "_distribute_module_applied", False):
            out.append(f"{path}._distribute_module_applied")
    return out


def attempt(call, model) -> dict:
    """Run `call(model)` and report the error, the seconds it took to arrive and whether `model` is intact."""
    snap = snapshot(model) if model is not None else None
    before = leftovers(model) if model is not None else []  # unfuse's own inference-packing hook on the root
    start = time.monotonic()
    counter = CollectiveCounter()  # every collective the call issued (c10d and functional), by op
    try:
        with counter:
            call(model)
        error = None
    except surgery.SurgeryError as e:
        error = str(e)
    except Exception as e:  # a timeout or a raw error is a failed case, reported as such
        error = f"NOT A SurgeryError: {type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    try:
        if model is None:
            pass
        elif any(p.is_meta for p in model.parameters()):  # no values to compare: the very same objects, then
            modules, params = snap
            assert [(n, id(m), type(m)) for n, m in model.named_modules()] == modules
            assert {n: id(p) for n, p in model.named_parameters()} == {n: pid for n, (pid, _) in params.items()}
        else:
            assert_unchanged(model, snap)
        intact = True
    except AssertionError:
        intact = False
    left = [x for x in leftovers(model) if x not in before] if model is not None else []
    return {"error": error, "seconds": seconds, "intact": intact, "leftovers": left,
            "collectives": dict(counter.counts)}


def shard(mesh, src_data_rank=0):
    return lambda m: surgery.tensor_parallel(m, mesh, src_data_rank=src_data_rank)


def failing_in_block(n: int, on_rank: int, rank: int):
    """`parallelize_module` that raises on its `n`-th call on one rank only (one call per double-stream block, so
    n=2 is block 2, `transformer_blocks.1`, after block 1 was sharded)."""
    module = sys.modules["surgery.parallel.tensor_parallel"]
    original, calls = module.parallelize_module, []

    def parallelize(*args, **kwargs):
        calls.append(1)
        if rank == on_rank and len(calls) == n:
            raise MemoryError("simulated: out of memory while sharding")
        return original(*args, **kwargs)

    return mock.patch.object(module, "parallelize_module", parallelize)


def run(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    other = rank == 1
    out = {}
    started = time.monotonic()

    # one rank refuses (its model is still fused) while the other has nothing to object to
    out["refuses"] = attempt(shard(mesh), build(CONFIG) if other else unfused())
    # each rank keeps its own weights, and they differ
    out["weights"] = attempt(shard(mesh, None), unfused(seed=1 if other else 0))
    # another config on one rank, under src_data_rank=0 (shards of other sizes would be sent)
    wider = dict(CONFIG, mlp_ratio=3.0)
    out["config"] = attempt(shard(mesh), unfused(wider if other else CONFIG))
    # another dtype on one rank
    out["dtype"] = attempt(shard(mesh, None), unfused(dtype=torch.bfloat16 if other else torch.float32))
    # meta weights on one rank with src_data_rank=0: nothing to receive into
    if other:
        with torch.device("meta"):
            meta = surgery.unfuse(type(build(CONFIG)).from_config(build(CONFIG).config))
    out["meta"] = attempt(shard(mesh), meta if other else unfused())
    # the ranks reach the same point in different verbs (the handshake counts arrivals only): the exchange names them
    verb = "save_pretrained" if other else "tensor_parallel"
    out["verbs"] = attempt(lambda m: agree(mesh, verb, lambda: None), None)

    # shard_lora on rank 0 only (`if rank == 0:`): rank 0 raises within the handshake timeout naming rank 1; the
    # barrier keeps rank 1 from meeting rank 0's handshake with its next verb
    from peft import LoraConfig

    model = surgery.tensor_parallel(unfused(), mesh)
    model.add_adapter(LoraConfig(r=2, target_modules=["to_out.0"]))
    local = {n: (id(p), p.to_local().clone() if hasattr(p, "to_local") else p.detach().clone())
             for n, p in model.named_parameters()}  # per rank: torch.equal on a DTensor would be a collective
    if not other:
        with mock.patch.dict("os.environ", {"SURGERY_HANDSHAKE_TIMEOUT": "2"}):
            out["shard_lora_alone"] = attempt(lambda _: surgery.lora.shard_lora(model), None)
        out["shard_lora_alone"]["intact"] = all(
            id(p) == local[n][0] and torch.equal(p.to_local() if hasattr(p, "to_local") else p.detach(), local[n][1])
            for n, p in model.named_parameters())
    dist.barrier(group)

    # a failure midway (block 2, one rank only): every rank rolls back to the very same objects, and can retry
    reference = build(CONFIG, 3)
    kw = inputs(CONFIG, 3)
    for src in (0, None):
        model = unfused(seed=3)
        with failing_in_block(2, 1, rank):
            out[f"midway_{src}"] = attempt(shard(mesh, src), model)
        surgery.tensor_parallel(model, mesh, src_data_rank=src)
        with torch.no_grad():
            out[f"midway_{src}"]["retry"] = rel_err(model(**kw).sample, reference(**kw).sample)

    # load_tensor_parallel: one rank cannot read its checkpoint; the other reads a good one
    with tempfile.TemporaryDirectory() as tmp:
        build(CONFIG).save_pretrained(tmp)
        folder = f"{tmp}/missing" if other else tmp
        start = time.monotonic()
        try:
            surgery.load_tensor_parallel(None, folder, mesh, progress=False)
            error = None
        except surgery.SurgeryError as e:
            error = str(e)
        except Exception as e:
            error = f"NOT A SurgeryError: {type(e).__name__}: {e}"
        out["load"] = {"error": error, "seconds": time.monotonic() - start, "intact": True, "leftovers": []}
        dist.barrier(group)  # rank 0 keeps the folder until rank 1 is done with it
    dist.destroy_process_group(group)
    out["total_seconds"] = time.monotonic() - started
    return out
