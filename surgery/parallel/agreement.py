"""Ranks agree before the first collective: every rank's verdict and a fingerprint of its model, exchanged once.

A rank that refuses while the others go on would leave them waiting in a collective for the process group's timeout
(30 minutes by default); ranks that hold different models would silently compute different things. So every rank
runs its checks locally, catching its own error, and then all ranks exchange (one `all_gather_object` over the mesh's
group) their verdict and a digest of each part of a fingerprint: the model's class and config, its tensors' names,
shapes and dtypes, the mesh size and `src_data_rank`, and, where each rank keeps its own weights
(`src_data_rank=None`), a sampled checksum of the weights. Any refusal or difference raises the same `SurgeryError` on
every rank, naming the rank and the difference; only then does a second exchange carry the differing parts in full,
to name the first difference. torch has no such handshake: `parallelize_module` trusts every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from datetime import timedelta
import os

from surgery.core.errors import SurgeryError
from surgery.parallel.quantized import local_parts, quantized

T = TypeVar("T")

# Elements sampled per tensor for the weights checksum: evenly spaced over the flattened tensor, first and last
# included. Cost: one gather of <= SAMPLE elements and a copy of <= 4 KiB to the host per tensor, whatever its size
# (FLUX.2-dev's ~1,000 tensors: ~1M elements in all). It sees a different checkpoint, seed, dtype cast or merged
# adapter (they change nearly every element), not a difference confined to elements it does not sample.
SAMPLE = 1024


def sampled_checksum(tensor: torch.Tensor) -> str:
    """A short digest of `SAMPLE` evenly spaced elements of `tensor` (its bytes, so -0.0 != 0.0 and NaNs count)."""
    if tensor.is_meta:
        return "meta"
    if quantized(tensor):  # a quantized weight: its stored values and scales
        return "+".join(sampled_checksum(part) for part in local_parts(tensor))
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return "empty"
    # Exact integer arithmetic: a float32 `linspace` rounds indices past 2**24 (a FLUX.2-dev block Linear holds
    # ~10**8 elements), and its last index rounds up to `n`, out of bounds. `i * (n - 1) // (k - 1)` in int64 is
    # exact for any tensor torch can hold.
    k = min(n, SAMPLE)
    steps = torch.arange(k, dtype=torch.int64, device=flat.device)
    index = steps * (n - 1) // max(k - 1, 1)
    sample = flat[index].contiguous().cpu()
    return hashlib.blake2b(sample.view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


# What ranks compare of a file they read (`file_identity`): its first bytes (a safetensors or GGUF header, for any
# checkpoint short of thousands of tensors) and SAMPLE evenly spaced pieces of the rest. One read of HEAD_BYTES and
# SAMPLE reads of PIECE bytes per file, whatever its size; like the weights checksum it sees another checkpoint,
# format or version of a file (they differ nearly everywhere), not an edit confined to bytes it does not read.
HEAD_BYTES = 1 << 20
PIECE = 64


def file_identity(fd: int) -> str:
    """The size of the open file `fd` and a digest of its first `HEAD_BYTES` and of `SAMPLE` pieces of the rest."""
    size = os.fstat(fd).st_size
    digest = hashlib.blake2b(os.pread(fd, min(size, HEAD_BYTES), 0), digest_size=8)
    rest = size - HEAD_BYTES - PIECE
    if rest > 0:
        for i in range(SAMPLE):
            digest.update(os.pread(fd, PIECE, HEAD_BYTES + i * rest // (SAMPLE - 1)))
    return f"{size} bytes, digest {digest.hexdigest()}"


def tensors_identity(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of in-memory tensors' names, shapes, dtypes and sampled values (`sampled_checksum`)."""
    entries = [(name, tuple(t.shape), str(t.dtype), sampled_checksum(t)) for name, t in sorted(tensors.items())]
    return f"{len(entries)} tensors, digest {hashlib.blake2b(repr(entries).encode(), digest_size=8).hexdigest()}"


def _config(model: nn.Module) -> dict[str, str]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "items"):
        return {}
    # diffusers' private keys (`_name_or_path`, `_diffusers_version`, ...) may differ between ranks harmlessly
    return {key: repr(value) for key, value in sorted(config.items()) if not str(key).startswith("_")}


def fingerprint(model: nn.Module, mesh_size: int, src_data_rank: int | None, weights: bool,
                files: dict[str, str] | None = None) -> dict[str, dict]:
    """What every rank must hold alike before sharding, in parts that can be compared one by one. `files`: what the
    rank read, by name (a file's name, `file_identity`), compared first: ranks that read different files hold
    different weights even where every shape agrees."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    parts = {} if files is None else {"files": dict(files)}
    parts |= {
        "model": {"class": f"{type(model).__module__}.{type(model).__qualname__}"},
        "config": _config(model),
        "call": {
            "mesh size": str(mesh_size),
            "src_data_rank": str(src_data_rank),
            "weights on": ", ".join(sorted({t.device.type for _, t in tensors})),
        },
        "tensors": {name: f"shape {tuple(t.shape)}, dtype {t.dtype}" for name, t in tensors},
    }
    if weights:
        parts["weights"] = {name: sampled_checksum(t) for name, t in tensors}
    return parts


def _digest(part: dict) -> str:
    return hashlib.blake2b(repr(sorted(part.items())).encode(), digest_size=16).hexdigest()


_FIXES = {
    "files": "Every rank must read the same checkpoint or adapter: pass the same file or folder (or identical copies) "
    "on every rank, and do not replace it while the ranks read.",
    "model": "Every rank must build the same model class.",
    "config": "Every rank must build the model from the same config.",
    "call": "Call it with the same mesh and src_data_rank on every rank.",
    "tensors": "Every rank must build the same model from the same config, in the same dtype, and edit it alike.",
    "weights": "With src_data_rank=None each rank keeps its own weights: load the same checkpoint (and seed) on every "
    "rank, or pass src_data_rank=0 to give every rank rank 0's weights.",
    "decode": "Every rank must decode the same latents (shape and dtype) with the same tile sizes.",
}


def _difference(part: str, mine: dict, theirs: dict, rank: int, reference: int) -> str:
    """The first difference in one part of two ranks' fingerprints, in words."""
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a == b:
            continue
        if part == "files":
            said = [f"read {key!r} ({x})" if x else f"did not read {key!r}" for x in (a, b)]
            return f"rank {rank} {said[0]}, rank {reference} {said[1]}"
        if a is None:
            return f"rank {rank} has no {key!r}, rank {reference} has one ({b})"
        if b is None:
            return f"rank {rank} has {key!r} ({a}), rank {reference} has none"
        if part == "tensors":
            return f"rank {rank}: {key!r} has {a}, rank {reference} {b}"
        if part == "weights":
            return f"rank {rank}: {key!r} holds other values than rank {reference}'s (sampled checksum {a} vs {b})"
        if part == "model":
            return f"rank {rank} has a {a}, rank {reference} a {b}"
        return f"rank {rank}: {key}={a}, rank {reference} {key}={b}"
    return f"rank {rank} differs from rank {reference} in {part}"


def _exchange(group, obj: Any, world: int) -> list[Any]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _group(where) -> tuple[Any, int]:
    """(process group, size) of a DeviceMesh (its one dim), a ProcessGroup, or None: every rank of the job."""
    if where is None:
        return dist.distributed_c10d._get_default_group(), dist.get_world_size()
    if hasattr(where, "get_group"):
        return where.get_group(), where.size()
    return where, dist.get_world_size(where)


def _exchanges(where) -> bool:
    """Whether there is anyone to agree with (not for one rank, nor under torch's fake process group)."""
    if not dist.is_initialized():
        return False
    group, world = _group(where)
    return world > 1 and dist.get_backend(group) != "fake"


# --- handshake: every rank of the group called the verb ---------------------------------------------------------
#
# A collective verb called on some ranks only (`if rank == 0: model.save_pretrained(...)`) would leave those ranks
# waiting in the first exchange until the process group's timeout (30 minutes by default), and gloo's timeout message
# names no cause. So the first exchange of every verb is preceded by a handshake through the process group's store,
# which has a timeout of its own: each rank counts itself in, and waits at most `handshake_timeout()` seconds for the
# others. torch has no such check for a subset of ranks (`monitored_barrier` needs a gloo group, which cannot be
# created at that point without the very collective that would hang).

HANDSHAKE_TIMEOUT_S = 30.0
_TIMEOUT_VARIABLE = "SURGERY_HANDSHAKE_TIMEOUT"
_POISON = 1 << 40  # added to a call's arrival count by the rank that stopped waiting first: later arrivals see it


def handshake_timeout() -> float:
    """Seconds a rank waits for the others to call the same verb: `SURGERY_HANDSHAKE_TIMEOUT`, default 30."""

    text = os.environ.get(_TIMEOUT_VARIABLE)
    if not text:
        return HANDSHAKE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SurgeryError(f"{_TIMEOUT_VARIABLE}={text!r}: give a number of seconds greater than 0.")
    return value


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def all_ranks_called(where, verb: str, timeout: float | None = None) -> None:
    """Return once every rank of the group has called `verb` at this point; raise a `SurgeryError` after `timeout`
    seconds (default `handshake_timeout()`) on a rank whose peers did not come, naming them.

    Calls meet in numbered slots of the store. The slot's number is read from the store (not counted by each rank),
    and moves on when a slot completes or is given up, so that a call on some ranks only does not shift every later
    call out of step: the next call on every rank meets in a fresh slot again.
    """

    group, world = _group(where)
    timeout = handshake_timeout() if timeout is None else timeout
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, KeyError, AttributeError):  # a process group without a store torch knows of
        return
    head = f"surgery/handshake/{getattr(group, 'group_name', 'world')}"
    slot = store.add(f"{head}/slot", 0)
    base = f"{head}/{slot}"
    me = dist.get_rank(group)
    store.set(f"{base}/rank{me}", verb)
    count = store.add(f"{base}/count", 1)
    if count > _POISON:
        raise SurgeryError(
            f"surgery.{verb}: another rank had stopped waiting for this call (its handshake timed out): not every "
            f"rank called it, or the ranks called surgery's collective verbs in different orders. Every rank must call "
            f"surgery.{verb} at the same point."
        )
    if count == world:  # the last to arrive moves the slot on, then lets everyone go
        store.add(f"{head}/slot", 1)
        store.set(f"{base}/all", "1")
    try:
        store.wait([f"{base}/all"], timedelta(seconds=timeout))
        return
    except RuntimeError:  # torch's DistStoreError (a RuntimeError) on timeout
        pass
    if store.check([f"{base}/all"]):
        return
    # Give up the slot, unless the last rank arrived in the meantime (one atomic add decides which came first).
    poisoned = store.add(f"{base}/count", _POISON)
    if poisoned // _POISON == 1:
        if poisoned % _POISON >= world:
            store.wait([f"{base}/all"], timedelta(seconds=timeout))
            return
        store.add(f"{head}/slot", 1)  # the first to give up moves the slot on
    came = [r for r in range(world) if store.check([f"{base}/rank{r}"])]
    missing = [r for r in range(world) if r not in came]
    raise SurgeryError(
        f"surgery.{verb}: {_ranks(missing)} did not call surgery.{verb} within {timeout:g} s ({_ranks(came)} did). "
        f"Every rank of the group must call it at the same point (not under `if rank == 0:`); nothing was changed. "
        f"If a rank is only slower than that, set {_TIMEOUT_VARIABLE} to more seconds."
    )


def _strip(message: str, verb: str) -> str:
    prefix = f"surgery.{verb}: "
    return message[len(prefix):] if message.startswith(prefix) else message


def _verdict(error: BaseException) -> str:
    if isinstance(error, SurgeryError):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def refusal(verb: str, verdicts: list[str | None], during: str = "") -> str | None:
    """The one message every rank raises when any rank refused (None if none did)."""
    failed: dict[str, list[int]] = {}
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            failed.setdefault(verdict, []).append(rank)
    if not failed:
        return None
    said = []
    for verdict, ranks in failed.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        said.append(f"{who}{f' failed {during}' if during else ''}: {_strip(verdict, verb)}")
    stopped = sorted(set(range(len(verdicts))) - {r for ranks in failed.values() for r in ranks})
    who = f"rank {stopped[0]}" if len(stopped) == 1 else f"ranks {', '.join(map(str, stopped))}"
    return f"surgery.{verb}: {'; '.join(said)}{f' ({who} stopped with it)' if stopped else ''}"


def agree(
    mesh,
    verb: str,
    check: Callable[[], T],
    fingerprint_of: Callable[[T], dict[str, dict]] | None = None,
    reference: int = 0,
    during: str = "",
    *,
    handshake: bool = True,
) -> T:
    """Run `check()` on every rank, then agree: return its result on every rank, or raise the same `SurgeryError`
    on every rank if any rank's check raised or any rank's fingerprint differs from rank `reference`'s.

    `mesh`: a 1-D DeviceMesh, a ProcessGroup, or None (every rank of the job). Every rank calls this at the same
    point; it runs a handshake (`all_ranks_called`: a rank whose peers never call it raises after
    `SURGERY_HANDSHAKE_TIMEOUT` seconds instead of waiting for the process group's timeout; pass `handshake=False`
    for a later exchange inside a verb that every rank has entered), then at most two small collectives over the
    group, and nothing when the group has one rank. A rank whose check raised something other than a `SurgeryError`
    re-raises that error itself (the others raise the `SurgeryError` that names it); a KeyboardInterrupt stays a
    KeyboardInterrupt on the rank that got it, after the others were told.
    """
    return agree_and_share(mesh, verb, check, None, fingerprint_of, reference, during, handshake=handshake)[0]


def agree_and_share(
    mesh,
    verb: str,
    check: Callable[[], T],
    share: Callable[[T], Any] | None = None,
    fingerprint_of: Callable[[T], dict[str, dict]] | None = None,
    reference: int = 0,
    during: str = "",
    *,
    handshake: bool = True,
) -> tuple[T, list[Any]]:
    """`agree`, and also every rank's `share(result)` (something small and picklable), by rank."""
    error: BaseException | None = None
    result = shared = None
    parts: dict[str, dict] = {}
    exchanges = _exchanges(mesh)
    if exchanges and handshake:
        all_ranks_called(mesh, verb)
    try:
        result = check()
        if share is not None:
            shared = share(result)
        if fingerprint_of is not None:
            parts = fingerprint_of(result)
    except BaseException as caught:  # noqa: BLE001 - reported to every rank, then re-raised below
        error = caught
    if not exchanges:
        if error is not None:
            raise error
        return result, [shared]
    group, world = _group(mesh)
    mine = (None if error is None else _verdict(error), {name: _digest(part) for name, part in parts.items()}, verb,
            shared)
    gathered = _exchange(group, mine, world)
    message = refusal(verb, [verdict for verdict, *_ in gathered], during)
    verbs = [v for _, _, v, _ in gathered]
    if message is None and len(set(verbs)) > 1:
        odd = next(r for r, v in enumerate(verbs) if v != verb)
        message = (f"surgery.{verb}: rank {odd} called surgery.{verbs[odd]} where this rank called surgery.{verb}: "
                   "every rank must call surgery's collective verbs in the same order.")
    if message is None:
        digests = [d for _, d, *_ in gathered]
        differing = [name for name in digests[reference] if any(d.get(name) != digests[reference][name] for d in digests)]
        if differing:
            # Every rank saw the same digests, so all of them take this second exchange. The first differing part
            # is the one named (a config difference also changes shapes, a dtype difference also the checksums).
            name = differing[0]
            full = _exchange(group, parts[name], world)
            what = "; ".join(
                _difference(name, full[rank], full[reference], rank, reference)
                for rank in range(world) if full[rank] != full[reference]
            )
            held = "read different data" if name == "files" else "hold different models"
            message = f"surgery.{verb}: the ranks {held}, so none of them went on: {what}. {_FIXES[name]}"
    if message is None:
        return result, [s for *_, s in gathered]
    if error is not None and not isinstance(error, SurgeryError):
        if isinstance(error, Exception):
            raise SurgeryError(message) from error
        raise error  # KeyboardInterrupt, SystemExit: this rank stops as asked, the others got the message
    raise SurgeryError(message) from None
