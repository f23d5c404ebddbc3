"""Helpers for tests, the demo, the benchmarks and the notebooks — not part of the verbs' API.

    from surgery.testing import rel_err, CollectiveCounter, run_on_cpu_ranks, seeded_model, diffusers_packed_tp
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator
from unittest import mock

import torch
import torch.nn as nn
from diffusers.models._modeling_parallel import TensorParallelConfig
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
import diffusers.hooks.tensor_parallel as dtp
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask, create_mask

from surgery.parallel.distributed import CollectiveCounter, leave_together, run_on_cpu_ranks
from surgery.core.build import default_dtype
from surgery.core.registry import Family, family_of, model_class
from surgery.core.build import sample, seeded_model

__all__ = [
    "BF16_TOL",
    "CollectiveCounter",
    "FP32_GRAD_TOL",
    "FP32_TOL",
    "assert_unchanged",
    "default_dtype",
    "dense_mask",
    "diffusers_packed_tp",
    "example_inputs",
    "family_of",
    "flex_as",
    "keep_attention_backend",
    "leave_together",
    "rel_err",
    "sample",
    "run_on_cpu_ranks",
    "seeded_model",
    "single_rank_group",
    "snapshot",
]

# The one set of tolerances (max relative error, `rel_err`) every test compares with. fp32: the unfused (and the
# sharded) model differs from the fused single-device one by summation order only. Measured (CPU, torch 2.13, the
# conformance suite's sharded case of each of the 37 families at world 2 and 4): outputs 1.5e-7 to 7.9e-7; gradients
# (inputs and parameters, each on its module's scale) up to 6.6e-6, and 1.1e-5 for ChronoEdit's image
# cross-attention (the weight gradients of its q/k norms across heads, sums of products over a few image tokens; the
# same sharded math in float64 matches to 1e-15, tests/families/test_ltx.py). Each bound is about 3x the largest
# measurement; a real drift (a wrong slice, a missing bias, a statistic not all-reduced) moves these by 1e-2 and more.
FP32_TOL = 2e-6
FP32_GRAD_TOL = 3e-5
# bf16 keeps 8 bits of mantissa: a split projection summed in another order moves outputs by up to about 1e-2.
BF16_TOL = 3e-2



def example_inputs(family: Family, config: dict, **kwargs) -> dict:
    """Seeded forward arguments for `family`'s model at `config` (see `Family.example_inputs`)."""
    return family.example_inputs(config, **kwargs)


def diffusers_packed_tp(model: nn.Module, mesh, plan: dict | None = None) -> nn.Module:
    """Shard `model` with diffusers' `apply_tensor_parallel` (what `enable_parallelism` calls) over `mesh`.

    The baseline that tests and benchmarks compare with. `plan` defaults to the model's `_tp_plan` (packed styles on a
    fused model; plain ones on an unfused model). diffusers refuses a CPU mesh; for a like-for-like comparison on gloo
    that one check is lifted here.
    """

    config = TensorParallelConfig(mesh=mesh)
    config.setup(mesh.get_rank(), mesh.size(), torch.device(mesh.device_type), mesh)
    supported = tuple(dict.fromkeys((*dtp._SUPPORTED_TP_DEVICES, mesh.device_type)))
    with mock.patch.object(dtp, "_SUPPORTED_TP_DEVICES", supported):
        dtp.apply_tensor_parallel(model, config, plan if plan is not None else model._tp_plan)
    return model


def keep_attention_backend(test) -> None:
    """Restore diffusers' process-wide active attention backend when `test` ends: `ModelMixin.set_attention_backend`
    sets it for every model in the process, not only the one it is called on."""

    test.addCleanup(_AttentionBackendRegistry.set_active_backend, _AttentionBackendRegistry.get_active_backend()[0])


@contextlib.contextmanager
def flex_as(backend: str | None) -> Iterator[None]:
    """Inside, diffusers' `flex` attention backend computes with `backend` (an `AttentionBackendName` value:
    "native" is SDPA) on the same query, key, value and scale, its `BlockMask` made dense (`dense_mask`): the
    attention the mask describes, computed by a kernel with a backward where `flex` has none (CPU, torch 2.13).
    Processors that name `flex` explicitly (diffusers' `attention_backend` context yields to an explicit backend)
    dispatch to it through diffusers' backend registry, so their own code runs unchanged. `None`: nothing changes.

    Eager flex attention (CPU without compiling) reads a `BlockMask`'s `mask_mod` only, not which blocks it lists;
    compiled flex reads both, and so does this kernel: where a mask lists fewer blocks than its `mask_mod` admits
    (Kandinsky 6 SR's NABLA selection), it computes the compiled kernel's attention, not the eager one's."""
    if backend is None:
        yield
        return

    registry = _AttentionBackendRegistry._backends
    other = registry[AttentionBackendName(backend)]

    def dense(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, _parallel_config=None,
              **_):
        if isinstance(attn_mask, BlockMask):  # diffusers' layout: (batch, tokens, heads, head_dim)
            attn_mask = dense_mask(attn_mask, query.shape[1], key.shape[1])
        return other(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                     _parallel_config=_parallel_config)

    with mock.patch.dict(registry, {AttentionBackendName.FLEX: dense}):
        yield


def dense_mask(mask, q_len: int, kv_len: int) -> torch.Tensor:
    """A flex attention `BlockMask` as the boolean `(batch, heads, q_len, kv_len)` mask SDPA takes: a key counts
    where its block is listed for the query's block, and either the block is full or the mask's `mask_mod` admits
    it (compiled flex applies `mask_mod` in partial blocks only)."""

    q_block, kv_block = mask.BLOCK_SIZE

    def tokens(blocks: torch.Tensor) -> torch.Tensor:
        spread = blocks.bool().repeat_interleave(q_block, -2).repeat_interleave(kv_block, -1)
        return spread[..., :q_len, :kv_len]

    listed = tokens(mask.to_dense())
    admitted = create_mask(mask.mask_mod, listed.shape[0], listed.shape[1], q_len, kv_len, device=listed.device)
    if mask.full_kv_num_blocks is not None:
        admitted = admitted | tokens(BlockMask.from_kv_blocks(
            mask.full_kv_num_blocks, mask.full_kv_indices, BLOCK_SIZE=mask.BLOCK_SIZE).to_dense())
    return listed & admitted


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """A gloo process group of one rank in this process, joined through a file store (no port to pick)."""

    with tempfile.TemporaryDirectory(prefix="surgery-store-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def snapshot(model: nn.Module) -> tuple:
    """Everything an atomic failure must leave unchanged: module objects, classes, parameter objects and values."""
    modules = [(name, id(m), type(m)) for name, m in model.named_modules()]
    params = {name: (id(p), p.detach().clone()) for name, p in model.named_parameters()}
    return modules, params


def assert_unchanged(model: nn.Module, snap: tuple) -> None:
    """Raise AssertionError unless `model` is exactly as `snapshot` saw it (same objects, same values)."""
    modules, params = snap
    now_modules = [(name, id(m), type(m)) for name, m in model.named_modules()]
    assert now_modules == modules, "the module tree changed"
    now = dict(model.named_parameters())
    assert now.keys() == params.keys(), "the parameter names changed"
    for name, (pid, value) in params.items():
        assert id(now[name]) == pid, f"{name}: another Parameter object"
        assert torch.equal(now[name].detach(), value), f"{name}: other values"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, computed in fp64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
