"""The VAE decoded once across the ranks: each rank runs its share of diffusers' own tiled decode, then one gather.

diffusers' `tiled_decode` (and the video VAEs' temporal tiling) calls the VAE's `decoder` once per tile, or once per
frame chunk of a tile, keeps every decoded tile, and only then blends neighbours and stitches them. So the decode is
split at the `decoder` calls, and diffusers' own code runs unchanged around them, twice:

1. every rank runs the VAE's own `decode`; its `decoder` computes the calls of the tiles this rank owns and, for the
   others, only their shapes: the decoder run on the meta device (`torch.func.functional_call` with meta copies of
   its weights: no memory, no arithmetic), or, for a call that takes and hands on no state, the shape an earlier
   call with the same arguments' shapes gave. Every call returns a placeholder on the meta device, so diffusers'
   blending runs on shapes only and nothing is written into a decoded tile;
2. the ranks agree (the same calls, the same shapes, nobody failed), then one `all_gather` gives every rank every
   decoded tile, as bytes;
3. every rank runs `decode` again; its `decoder` computes nothing and hands back the gathered tiles in call order, so
   diffusers blends and stitches exactly the tensors the single-device tiled decode would: the result is that decode,
   bitwise (each tile is computed by the same kernels on the same input, and the bytes travel unchanged).

Tiles are owned round robin. A tile decoded in frame chunks (Wan's causal cache, CogVideoX's `conv_cache`) is one
chain of calls that hand state on to the next, through the decoder's arguments or outputs; the chain stays on one
rank. A call continues a chain when one of its arguments is a tensor that the previous call returned (beside the
decoded sample) or wrote into its arguments; any other call starts a new tile.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import types
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves

from surgery.core.errors import SurgeryError
from surgery.parallel.agreement import _group, _exchanges, agree, fingerprint
from surgery.parallel.distributed import one_dim_mesh

VERB = "decode_parallel"
_ALIGN = 64  # bytes: every tile starts on an offset any dtype can be viewed from
# The attributes `enable_tiling` sets (and that a user may have set before): restored after every decode.
_TILING_STATE = ("use_tiling", "use_framewise_decoding", "tile_")


def _tensors(*trees) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(trees) if isinstance(leaf, torch.Tensor)]


def _sample(output) -> tuple[torch.Tensor, tuple | None]:
    """The decoded sample of a `decoder` call and what else it returned (CogVideoX: `(sample, conv_cache)`)."""
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0], output[1:]
    raise SurgeryError(f"surgery.{VERB}: the VAE's decoder returned {type(output).__name__}, not a tensor or a tuple "
                       "starting with one; this VAE cannot be decoded in parts.")


def _with_sample(sample: torch.Tensor, rest: tuple | None):
    return sample if rest is None else (sample, *rest)


@dataclass
class _Calls:
    """The `decoder` calls of one decode, in order: shapes, tiles (chains of calls) and who owns each."""

    rank: int
    world: int
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    inputs: list[tuple[int, ...]] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    rests: list[int | None] = field(default_factory=list)  # how many outputs beside the sample (None: a tensor)
    mine: list[torch.Tensor] = field(default_factory=list)
    tiles: int = 0
    carried: dict[int, torch.Tensor] = field(default_factory=dict)  # state the last call handed on, by id
    stateless: dict[str, tuple] = field(default_factory=dict)  # output shape by argument shapes, stateless calls
    meta: dict[str, torch.Tensor] | None = None  # the decoder's weights as meta tensors, by name under `_Run`

    def shapes_only(self, decoder: nn.Module, decoder_forward, args, kwargs):
        """The call run on the meta device: the decoder's weights and the call's tensors as meta tensors (tensors in
        containers, a cache the decoder fills, are already meta: written by its earlier meta calls)."""
        run = _Run(decoder, decoder_forward)
        if self.meta is None:
            self.meta = {name: torch.empty_like(t, device="meta")
                         for name, t in [*run.named_parameters(), *run.named_buffers()]}
        to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
        return torch.func.functional_call(run, self.meta, tuple(map(to_meta, args)),
                                          {k: to_meta(v) for k, v in kwargs.items()})

    def first_pass(self, decoder: nn.Module, decoder_forward, args, kwargs):
        given = _tensors(args, kwargs)
        continues = any(id(t) in self.carried for t in given)
        if not continues:
            self.tiles += 1
        owner = (self.tiles - 1) % self.world
        before = {id(t) for t in given}
        key = repr([(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in tree_leaves((args, kwargs))])
        if owner == self.rank:
            output = decoder_forward(*args, **kwargs)
        elif not continues and key in self.stateless:
            output = torch.empty(self.stateless[key][0], dtype=self.stateless[key][1], device="meta")
        else:
            output = self.shapes_only(decoder, decoder_forward, args, kwargs)
        sample, rest = _sample(output)
        handed_on = _tensors(rest) + [t for t in _tensors(args, kwargs) if id(t) not in before]
        self.carried = {id(t): t for t in handed_on}
        if not continues and not handed_on and rest is None:
            self.stateless[key] = (tuple(sample.shape), sample.dtype)
        self.shapes.append((tuple(sample.shape), sample.dtype))
        self.inputs.append(tuple(given[0].shape) if given else ())
        self.owners.append(owner)
        self.rests.append(None if rest is None else len(rest))
        if owner == self.rank:
            self.mine.append(sample.detach())
        return _with_sample(torch.empty(sample.shape, dtype=sample.dtype, device="meta"), rest)

    def layout(self, latents: str) -> dict[str, str]:
        """What every rank must have seen alike before the gather (compared by digest)."""
        calls = repr(list(zip(self.inputs, self.shapes, self.owners)))
        return {"latents": latents, "calls": f"{len(self.shapes)} decoder calls in {self.tiles} tiles",
                "layout": hashlib.blake2b(calls.encode(), digest_size=16).hexdigest()}


class _Run(nn.Module):
    """The decoder's own forward (its `forward` is replaced meanwhile), under a module `functional_call` can
    reparametrize."""

    def __init__(self, decoder: nn.Module, forward):
        super().__init__()
        self.decoder = decoder
        self.run = forward

    def forward(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return -(-nbytes // _ALIGN) * _ALIGN


def _gather(calls: _Calls, group, device: torch.device) -> list[torch.Tensor]:
    """Every call's decoded sample on every rank: one all_gather of each rank's tiles, as bytes."""
    sizes = [0] * calls.world
    for (shape, dtype), owner in zip(calls.shapes, calls.owners):
        sizes[owner] += _nbytes(shape, dtype)
    width = max(max(sizes), _ALIGN)
    send = torch.zeros(width, dtype=torch.uint8, device=device)
    offset = 0
    for sample in calls.mine:
        flat = sample.contiguous().reshape(-1).view(torch.uint8)
        send[offset:offset + flat.numel()].copy_(flat)
        offset += _nbytes(tuple(sample.shape), sample.dtype)
    calls.mine.clear()
    received = [torch.empty_like(send) for _ in range(calls.world)]
    dist.all_gather(received, send, group=group)
    offsets = [0] * calls.world
    samples = []
    for (shape, dtype), owner in zip(calls.shapes, calls.owners):
        nbytes = _nbytes(shape, dtype)
        count = 1
        for size in shape:
            count *= size
        start = offsets[owner]
        samples.append(received[owner][start:start + nbytes].view(dtype)[:count].view(shape))
        offsets[owner] += nbytes
    return samples


@contextlib.contextmanager
def _decoder_calls(decoder: nn.Module, replace) -> Iterator[None]:
    """`decoder`'s forward replaced by `replace(original_forward, args, kwargs)` for the duration (hooks still run)."""
    had = "forward" in decoder.__dict__
    previous = decoder.__dict__.get("forward")
    original = decoder.forward
    decoder.forward = lambda *args, **kwargs: replace(original, args, kwargs)
    try:
        yield
    finally:
        if had:
            decoder.forward = previous
        else:
            del decoder.forward


@contextlib.contextmanager
def _tiling_on(vae: nn.Module) -> Iterator[None]:
    """diffusers' tiled decode on, with the VAE's tile sizes; its tiling state exactly as it was afterwards."""
    saved = {k: v for k, v in vae.__dict__.items() if k.startswith(_TILING_STATE)}
    try:
        vae.enable_tiling()
        yield
    finally:
        for key in [k for k in vae.__dict__ if k.startswith(_TILING_STATE)]:
            if key not in saved:
                delattr(vae, key)
        vae.__dict__.update(saved)


def _split_decode(vae: nn.Module, mesh: DeviceMesh, original, args, kwargs):
    if torch.is_grad_enabled() and any(p.requires_grad for p in vae.parameters()):
        return original(*args, **kwargs)  # the gather carries no gradient: the whole decode, as diffusers runs it
    group, world = _group(mesh)
    rank = dist.get_rank(group)
    calls = _Calls(rank, world)
    device: list[torch.device] = []

    def first(forward, call_args, call_kwargs):
        if not device:
            device.extend(t.device for t in _tensors(call_args, call_kwargs)[:1])
        return calls.first_pass(vae.decoder, forward, call_args, call_kwargs)

    def run_first_pass() -> _Calls:
        with _tiling_on(vae), _decoder_calls(vae.decoder, first):
            original(*args, **kwargs)
        return calls

    latents = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in _tensors(args, kwargs))
    agree(mesh, VERB, run_first_pass, lambda c: {"decode": c.layout(latents)}, during="decoding its tiles")
    samples = iter(_gather(calls, group, device[0] if device else torch.device("cpu")))
    replayed = iter(zip(calls.inputs, calls.rests))

    def second(forward, call_args, call_kwargs):
        given = _tensors(call_args, call_kwargs)
        expected, rest = next(replayed, (None, None))
        if expected is None or (given and tuple(given[0].shape) != expected):
            raise SurgeryError(f"surgery.{VERB}: {type(vae).__name__}'s decode called its decoder differently the "
                               "second time (its tiles depend on more than the latents' shape); decode it whole.")
        # what the decoder handed on beside the sample went to its next call only, which this pass does not run
        return _with_sample(next(samples), None if rest is None else (None,) * rest)

    with _tiling_on(vae), _decoder_calls(vae.decoder, second):
        return original(*args, **kwargs)


def _check(vae: nn.Module) -> None:
    name = type(vae).__name__
    missing = [a for a in ("decoder", "tiled_decode", "enable_tiling", "decode") if not hasattr(vae, a)]
    if missing:
        raise SurgeryError(f"surgery.{VERB}: {name} has no {', '.join(missing)}: only a VAE with diffusers' tiled "
                           "decode (`enable_tiling`, `tiled_decode`, a `decoder` module) can be decoded in parts; "
                           "leave it whole.")
    if not isinstance(vae.decoder, nn.Module):
        raise SurgeryError(f"surgery.{VERB}: {name}.decoder is a {type(vae.decoder).__name__}, not a module; leave it "
                           "whole.")
    try:
        with _tiling_on(vae):
            pass
    except NotImplementedError as error:
        raise SurgeryError(f"surgery.{VERB}: {name} refuses diffusers' tiling ({error}); leave it whole.") from None


def decode_parallel(vae: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split `vae.decode` across the ranks of `mesh`, in place; returns `vae`.

    Each call of `vae.decode` (by the user or a pipeline) then runs diffusers' own tiled decode with each rank
    computing its share of the tiles (and of the frame chunks, where the VAE tiles time), and one all_gather: the
    result is the single-device tiled decode's, bitwise, on every rank. The weights stay whole on every rank. Tiling
    is on during the decode (with the VAE's tile sizes: set them with `vae.enable_tiling(...)` before) and its state
    is put back after. With gradients enabled the VAE decodes whole (the gather carries none). Call it, and every
    decode, on every rank alike. A VAE without diffusers' tiled decode raises a `SurgeryError` and is left as it was.
    """
    mesh = one_dim_mesh(mesh, "decode_parallel")
    agree(mesh, VERB, lambda: _check(vae), lambda _: fingerprint(vae, mesh.size(), None, weights=True))
    vae.__dict__.pop("decode", None)  # split again over this mesh
    if _exchanges(mesh):
        # a method of the VAE (bound anew by copy.deepcopy), not a closure over this one
        vae.decode = types.MethodType(functools.partial(_decode, mesh), vae)
    return vae


def _decode(mesh: DeviceMesh, vae: nn.Module, *args, **kwargs):
    return _split_decode(vae, mesh, type(vae).decode.__get__(vae), args, kwargs)  # diffusers' own, with its hooks
