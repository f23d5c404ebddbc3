"""What each gloo rank runs for the quantized tensor-parallel tests: torchao quantization before and after
`tensor_parallel`, against the same quantized model run whole on one process."""

from __future__ import annotations

import copy
import functools
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

warnings.filterwarnings("ignore")

import surgery  # noqa: E402
from surgery.core.errors import SurgeryError  # noqa: E402
from surgery.parallel.plans import effective_plan  # noqa: E402
from surgery.parallel.quantized import held_bytes, local_parts  # noqa: E402
from flux2_testing import build, inputs, rel_err, small_config  # noqa: E402

from surgery_rewrites.flux2 import FAMILY  # noqa: E402

CONFIG = "tp_wide"


def configs() -> dict:
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    return {
        "int8_weight_only": Int8WeightOnlyConfig(),
        "int8_dynamic_activation": Int8DynamicActivationInt8WeightConfig(),
        "float8_weight_only": Float8WeightOnlyConfig(),
        # blocks of 16 input columns: every rowwise cut over 2 ranks (32 and 80 columns) falls on a boundary
        "int8_groups_of_16": Int8WeightOnlyConfig(granularity=PerGroup(16)),
    }


def in_blocks(module, fqn: str) -> bool:
    """The Linears of the transformer blocks: what the plan shards and what holds nearly all the weights."""
    return isinstance(module, torch.nn.Linear) and "transformer_blocks." in fqn


def quantize_all(model, config, filter_fn=None):
    from torchao.quantization import quantize_

    quantize_(model, config, filter_fn=filter_fn)
    return model


def _forward(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def sharded_bytes_expected(whole, model, world: int) -> int:
    """What a rank should hold: every inner tensor the sharded model cuts, over `world`; everything else whole."""
    total = 0
    for name, param in whole.named_parameters():
        mine = model.get_parameter(name)
        whole_parts, my_parts = _parts(param), _parts(mine)
        for w, m in zip(whole_parts, my_parts):
            cut = isinstance(m, DTensor) and m.placements[0].is_shard()
            total += w.nbytes // world if cut else w.nbytes
    return total + sum(b.nbytes for b in whole.buffers())


def _parts(tensor):
    from surgery.parallel.quantized import _inner, torchao_tensor

    if torchao_tensor(tensor):
        return [p for p in _inner(tensor)[0].values() if p is not None]
    return [tensor]


def run(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    config = small_config(CONFIG)
    kw = inputs(config, seed=0, batch=2)
    unfused = surgery.unfuse(build(config, seed=0))
    # rank 0's weights are the reference; the others start from other weights, which tensor_parallel's
    # src_data_rank=0 replaces with rank 0's shards (quantized values included)
    mine = unfused if rank == 0 else surgery.unfuse(build(config, seed=1))
    result = {}
    float_out = _forward(unfused, kw)
    for name, qconfig in configs().items():
        # every Linear (torchao's default), except for groups of 16, which the 24 input features of the context
        # embedder do not divide into
        quantize = functools.partial(quantize_all, filter_fn=in_blocks if "groups" in name else None)
        whole = quantize(copy.deepcopy(unfused), qconfig)
        expected = _forward(whole, kw)
        row = {"whole_bytes": held_bytes(whole), "whole_vs_float": rel_err(expected, float_out)}

        before = quantize(copy.deepcopy(mine), qconfig)
        surgery.tensor_parallel(before, mesh)
        row["before"] = rel_err(_forward(before, kw), expected)
        row["before_bytes"] = held_bytes(before)
        row["before_expected_bytes"] = sharded_bytes_expected(whole, before, world)
        row["before_sharded"] = sum(
            isinstance(p, DTensor) and p.placements[0].is_shard()
            for t in before.parameters() for p in _parts(t))

        after = copy.deepcopy(mine)
        surgery.tensor_parallel(after, mesh)
        quantize(after, qconfig)
        row["after"] = rel_err(_forward(after, kw), expected)
        row["after_bytes"] = held_bytes(after)

        # the same quantized model given to stock parallelize_module with the same plan
        stock = quantize(copy.deepcopy(unfused), qconfig)
        try:
            for path, plan in effective_plan(stock).items():
                parallelize_module(stock.get_submodule(path) if path else stock, mesh, plan)
            row["stock"] = f"ran: {rel_err(_forward(stock, kw), expected):.1e}"
        except Exception as error:  # noqa: BLE001 - recorded for the report
            row["stock"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        result[name] = row
    result["int8_dynamic_activation"]["sensitivity"] = sensitivity(unfused, kw, configs()["int8_dynamic_activation"])
    result["dynamic_two_linears"] = two_linears(mesh, configs()["int8_dynamic_activation"])
    result["refusals"] = refusals(mesh, unfused)
    result["src_data_rank=None"] = own_copies(mesh, unfused, mine, kw)
    result["midway"] = midway(mesh, unfused, kw)
    from surgery.sight.report import quantized_plan

    for quant, measured in (("int8", "int8_weight_only"), ("fp8", "float8_weight_only")):
        planned = quantized_plan(config, [world], quant, family=FAMILY, dtype=torch.float32)["rows"][0]
        result[measured]["planned_bytes"] = planned["bytes_per_rank"]
    return result


def sensitivity(unfused, kw, qconfig) -> float:
    """How far the whole quantized model moves when its input moves by float noise (1e-7 relative): dynamic
    activation quantization rounds activations, so noise that crosses a rounding boundary changes them by one int8
    step, and later layers carry that on."""
    whole = quantize_all(copy.deepcopy(unfused), qconfig)
    expected = _forward(whole, kw)
    noisy = dict(kw)
    generator = torch.Generator().manual_seed(0)
    x = kw["hidden_states"]
    noisy["hidden_states"] = x * (1 + 1e-7 * torch.randn(x.shape, generator=generator))
    return rel_err(_forward(whole, noisy), expected)


def two_linears(mesh, qconfig) -> float:
    """A colwise then a rowwise Linear, dynamically quantized, sharded by surgery vs run whole: the first quantization
    sees the very same input, so the per-token scales (taken over the whole row, across ranks) and the int32 sums must
    agree to float noise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 160, bias=False), torch.nn.Linear(160, 64, bias=False))
    x = torch.randn(2, 16, 64)
    whole = quantize_all(copy.deepcopy(base), qconfig)
    with torch.no_grad():
        expected = whole(x)
    model = quantize_all(copy.deepcopy(base), qconfig)
    surgery.tensor_parallel(model, mesh, plan={"0": ColwiseParallel(), "1": RowwiseParallel()})
    with torch.no_grad():
        return rel_err(model(x), expected)


def own_copies(mesh, unfused, mine, kw) -> dict:
    """`src_data_rank=None`: each rank slices its own quantized copy, no weight collective; ranks holding different
    quantized weights are refused by the fingerprint before anything changes."""
    qconfig = configs()["int8_weight_only"]
    whole = quantize_all(copy.deepcopy(unfused), qconfig)
    model = quantize_all(copy.deepcopy(unfused), qconfig)
    surgery.tensor_parallel(model, mesh, src_data_rank=None)
    out = {"error": rel_err(_forward(model, kw), _forward(whole, kw))}
    different = quantize_all(copy.deepcopy(unfused), qconfig)
    if torch.distributed.get_rank() == 1:  # one int8 value of one quantized weight differs, nothing else
        with torch.no_grad():
            qdata = different.transformer_blocks[0].attn.to_q.weight.qdata
            qdata[0, 0] = qdata[0, 0] + (1 if qdata[0, 0] < 127 else -1)
    try:
        surgery.tensor_parallel(different, mesh, src_data_rank=None)
        out["different weights"] = None
    except SurgeryError as error:
        out["different weights"] = str(error)
    return out


def midway(mesh, unfused, kw) -> dict:
    """A failure while sharding block 2 on rank 1 of a quantized model: every rank puts back the very same Parameter
    objects with the very same quantized values and scales (block 1, sharded already, refilled from its shards), and
    the model then shards again."""
    from agreement_worker import failing_in_block

    qconfig = configs()["int8_weight_only"]
    expected = _forward(quantize_all(copy.deepcopy(unfused), qconfig), kw)
    out = {}
    for src in (0, None):
        model = quantize_all(copy.deepcopy(unfused), qconfig)
        snap = {name: (p, [part.clone() for part in _parts(p)]) for name, p in model.named_parameters()}
        with failing_in_block(2, 1, torch.distributed.get_rank()):
            try:
                surgery.tensor_parallel(model, mesh, src_data_rank=src)
                error = None
            except SurgeryError as caught:
                error = str(caught)
        now = dict(model.named_parameters())
        same = all(now[name] is p and all(torch.equal(a, b) for a, b in zip(_parts(now[name]), parts))
                   for name, (p, parts) in snap.items()) and now.keys() == snap.keys()
        surgery.tensor_parallel(model, mesh, src_data_rank=src)
        out[src] = {"error": error, "same": same, "retry": rel_err(_forward(model, kw), expected)}
    return out


def refusals(mesh, unfused) -> dict:
    """Layouts a cut cannot split: refused before anything changes."""
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    out = {}
    # blocks of 32 columns: the single blocks' MLP down projection (160 columns) cut into 80 per rank splits a block
    model = quantize_all(copy.deepcopy(unfused), Int8WeightOnlyConfig(granularity=PerGroup(32)), in_blocks)
    snap = {name: (id(p), [part.clone() for part in _parts(p)]) for name, p in model.named_parameters()}
    try:
        surgery.tensor_parallel(model, mesh)
        out["group_32"] = None
    except SurgeryError as error:
        out["group_32"] = str(error)
    for name, p in model.named_parameters():
        assert id(p) == snap[name][0], f"{name}: another Parameter object"
        assert all(torch.equal(a, b) for a, b in zip(_parts(p), snap[name][1])), f"{name}: other values"
    try:
        from torchao.quantization import Int4WeightOnlyConfig

        quantize_all(copy.deepcopy(unfused), Int4WeightOnlyConfig(group_size=32), in_blocks)
        out["int4"] = "quantized"
    except Exception as error:  # noqa: BLE001 - torchao's own refusal on this machine
        out["int4"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return out
