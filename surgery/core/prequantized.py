"""Pre-quantized weights diffusers loads (GGUF: `GGUFParameter` / `GGUFLinear`; BFL fp8r: `BFLFP8RLinear`) as tensors
that unfusing and tensor parallelism can cut.

diffusers keeps a GGUF weight as its raw bytes (`uint8`, `rows x bytes per row`, a `GGUFParameter`) inside a
`GGUFLinear` that dequantizes them in its forward. A GGUF row is whole blocks along the input dimension (32 columns per
block for Q8_0 / Q4_0, 256 for the K-quants), each block a fixed number of bytes, so:
- a slice of rows (what unfusing q/k/v or gate/up and a colwise cut take) is the same slice of byte rows;
- a slice of columns (a `SplitProjection`'s parts, a rowwise cut) is a slice of each row's bytes, when it starts and
  ends on a block boundary; a cut inside a block is refused.

`GGUFWeight` presents the logical weight (`out x in`, the compute dtype) around those bytes (`qdata`), like torchao's
quantized tensors: `nn.Linear`'s own forward calls `F.linear`, which dequantizes with diffusers' own
`dequantize_gguf_tensor` and multiplies. When `qdata` is a DTensor (each rank's cut of the bytes), the dequantization
runs per rank through `local_map` and gives a DTensor weight of the same placement, so DTensor inserts exactly the
collectives the unquantized plan has; no module holds TP logic.

A BFL fp8r weight (float8 values, one fp32 scale per row) needs no new tensor: it is torchao's weight-only
`Float8Tensor` with a per-row scale, whose slicing and sharding torchao and `surgery.parallel.quantized` already do.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import local_map

from surgery.core.errors import SurgeryError
from surgery.core.optional import need

aten = torch.ops.aten


def _gguf():
    """The `gguf` package and diffusers' GGUF support (which needs it)."""
    gguf = need("gguf", "a GGUF checkpoint")
    return gguf, need("diffusers.quantizers.gguf.utils", "a GGUF checkpoint")


def block_layout(ggml_type: int) -> tuple[int, int]:
    """(columns per block, bytes per block) of a GGML quantization type."""
    gguf, _ = _gguf()
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


def type_name(ggml_type: int) -> str:
    return _gguf()[0].GGMLQuantizationType(ggml_type).name


def dequantizable(ggml_type: int) -> bool:
    """Whether diffusers' GGUF support dequantizes `ggml_type` (F32 and F16 load as plain tensors)."""
    return ggml_type in _gguf()[1].SUPPORTED_GGUF_QUANT_TYPES


def dequantizable_names() -> list[str]:
    return ["F32", "F16"] + [t.name for t in _gguf()[1].SUPPORTED_GGUF_QUANT_TYPES]


def _dequantize(qdata: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' own dequantization of GGUF bytes (`rows x bytes`), cast to `dtype` as `GGUFLinear` does."""
    utils = _gguf()[1]
    return utils.dequantize_gguf_tensor(utils.GGUFParameter(qdata.contiguous(), quant_type=ggml_type)).to(dtype)


class GGUFWeight(torch.Tensor):
    """A GGUF-quantized Linear weight: logical shape `(out, in)` and compute dtype, stored as GGUF bytes `qdata`
    (`(out, in / block * block_bytes)` uint8, a plain tensor or a DTensor of this rank's cut)."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, ggml_type: int, shape, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata: torch.Tensor, ggml_type: int, shape, dtype: torch.dtype):
        self.qdata = qdata
        self.ggml_type = int(ggml_type)

    def __repr__(self) -> str:
        return f"GGUFWeight({type_name(self.ggml_type)}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["qdata"], (self.ggml_type, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["qdata"], meta[0], outer_size, meta[1])

    @property
    def block(self) -> int:
        return block_layout(self.ggml_type)[0]

    def column_bytes(self, column: int) -> int:
        """The byte offset in each row where logical `column` starts (a block boundary)."""
        block, block_bytes = block_layout(self.ggml_type)
        return column // block * block_bytes

    def dequantized(self) -> torch.Tensor:
        """The logical weight: a plain tensor, or a DTensor of `qdata`'s placements (each rank its own cut)."""
        fn = functools.partial(_dequantize, ggml_type=self.ggml_type, dtype=self.dtype)
        if isinstance(self.qdata, DTensor):
            placements = tuple(self.qdata.placements)
            # one output: its placements as a list (a tuple would mean one placement per output)
            return local_map(fn, out_placements=list(placements), in_placements=(placements,),
                             device_mesh=self.qdata.device_mesh)(self.qdata)
        return fn(self.qdata)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if isinstance(weight, GGUFWeight) and not isinstance(x, GGUFWeight):
                return F.linear(x, weight.dequantized(), bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"GGUFWeight (a GGUF-quantized weight) does not implement {func}: it supports F.linear, slicing on "
                "block boundaries, cat, detach, clone and moving between devices."
            )
        return handler(*args, **kwargs)


def _same(t: GGUFWeight, qdata: torch.Tensor, shape=None, dtype=None) -> GGUFWeight:
    return GGUFWeight(qdata, t.ggml_type, t.shape if shape is None else shape, dtype or t.dtype)


def check_columns(weight: GGUFWeight, start: int, stop: int, where: str) -> None:
    """Refuses a column range of `weight` that does not start and end on a GGUF block boundary."""
    block = weight.block
    for edge in (start, stop):
        if edge % block:
            raise SurgeryError(
                f"{where} is GGUF {type_name(weight.ggml_type)}, quantized in blocks of {block} input columns; a cut "
                f"at column {edge} of {weight.shape[1]} falls inside a block (columns {edge // block * block}.."
                f"{edge // block * block + block}). Only cuts at multiples of {block} keep whole blocks: use a "
                f"checkpoint quantized with a smaller block (Q8_0 / Q4_0: 32) or an unquantized one."
            )


def _slice(t: GGUFWeight, dim: int = 0, start=None, end=None, step: int = 1) -> GGUFWeight:
    size = t.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None else (end + size if end < 0 else min(end, size))
    if step != 1 or dim not in (0, 1, -1, -2):
        raise NotImplementedError(f"GGUFWeight: only contiguous row or column slices, not dim {dim} step {step}")
    dim = dim % 2
    shape = list(t.shape)
    shape[dim] = end - start
    if dim == 0:
        return _same(t, t.qdata[start:end], shape)
    check_columns(t, start, end, "A GGUFWeight")
    return _same(t, t.qdata[:, t.column_bytes(start):t.column_bytes(end)], shape)


def _cat(tensors, dim: int = 0) -> GGUFWeight:
    first = tensors[0]
    if any(not isinstance(t, GGUFWeight) or t.ggml_type != first.ggml_type for t in tensors):
        raise NotImplementedError("GGUFWeight: cat joins GGUF weights of one quantization type only")
    dim = dim % 2
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return _same(first, torch.cat([t.qdata for t in tensors], dim), shape)


def _to_copy(t: GGUFWeight, dtype=None, device=None, **kwargs) -> GGUFWeight:
    # the bytes move; a dtype is the one the weight dequantizes to (what `model.to(dtype)` asks of a GGUF model)
    qdata = t.qdata if device is None else t.qdata.to(device)
    return _same(t, qdata, dtype=dtype or t.dtype)


_OPS = {
    aten.detach.default: lambda t: _same(t, t.qdata.detach()),
    aten.alias.default: lambda t: _same(t, t.qdata),
    aten.clone.default: lambda t, memory_format=None: _same(t, t.qdata.clone()),
    aten.slice.Tensor: _slice,
    aten.cat.default: _cat,
    aten._to_copy.default: _to_copy,
}


def gguf_weight(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, GGUFWeight)


def from_parameter(param: torch.Tensor, dtype: torch.dtype) -> GGUFWeight:
    """diffusers' `GGUFParameter` (bytes with a `quant_type`) as a `GGUFWeight` over the same bytes."""
    block, block_bytes = block_layout(param.quant_type)
    data = param.as_tensor().detach().view(torch.uint8)
    shape = (*data.shape[:-1], data.shape[-1] // block_bytes * block)
    return GGUFWeight(data, param.quant_type, shape, dtype)


def _adopt(model: nn.Module, match, weight_of) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace each module `match` accepts by a plain `nn.Linear` of its shape holding `weight_of(module)` and its
    bias; returns `(parent, name, module)` for `restore_adopted`. Every replacement is built before the first is
    swapped in, so one that fails leaves the model as it was."""
    built = []
    for path, module in list(model.named_modules()):
        if not match(module):
            continue
        with torch.device("meta"):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight = nn.Parameter(weight_of(module), requires_grad=False)
        if module.bias is not None:
            linear.bias = module.bias
        linear.train(module.training)
        owner, _, name = path.rpartition(".")
        built.append((model.get_submodule(owner), name, module, linear))
    for parent, name, _, linear in built:
        setattr(parent, name, linear)
    return [(parent, name, module) for parent, name, module, _ in built]


def adopt_gguf(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace each of `model`'s diffusers `GGUFLinear`s by a plain `nn.Linear` holding a `GGUFWeight` over the same
    bytes (no copy; the same dequantization and product). Returns what `restore_adopted` puts back (the verbs do when
    they refuse, so a refused call leaves the model as it was); empty for a model without GGUF Linears."""
    try:
        from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter  # needs the optional gguf package
    except ImportError:  # no gguf package: no model holds GGUF Linears
        return []
    return _adopt(
        model, lambda m: isinstance(m, GGUFLinear) and isinstance(m.weight, GGUFParameter),
        lambda m: from_parameter(m.weight, m.compute_dtype or (m.bias.dtype if m.bias is not None else torch.float32)))


def restore_adopted(swaps: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put back the Linears `adopt_gguf` / `adopt_fp8r` replaced."""
    for parent, name, module in reversed(swaps):
        setattr(parent, name, module)


def adopt_fp8r(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace each of `model`'s diffusers `BFLFP8RLinear`s (BFL's fp8r: float8 weight, per-row fp32 scale) by a plain
    `nn.Linear` holding torchao's weight-only `Float8Tensor` over the same values and scales (no copy; the same
    dequantization, `weight.float() * scale`, then the product): what `Float8WeightOnlyConfig()` builds, which
    unfusing slices and `tensor_parallel` shards. Returns what `restore_adopted` puts back."""
    if not any(type(m).__name__ == "BFLFP8RLinear" for m in model.modules()):
        return []  # torchao is imported only for a model that holds such Linears
    try:
        from diffusers.quantizers.bfl.utils import BFLFP8RLinear  # diffusers' BFL quantizer (recent diffusers)
        from torchao.quantization import Float8Tensor  # optional: torchao's float8 layout
    except ImportError:  # no such Linears, or nothing to hold them in
        return []
    return _adopt(model, lambda m: type(m) is BFLFP8RLinear, lambda m: Float8Tensor(
        m.weight.detach(), m.weight_scale.detach().float().reshape(-1, 1), block_size=[1, m.in_features],
        dtype=m.compute_dtype or torch.float32))


def adopt_prequantized(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """`adopt_gguf` and `adopt_fp8r`: a pre-quantized model's Linears as plain Linears the verbs can cut."""
    return adopt_gguf(model) + adopt_fp8r(model)


def per_row_float8(tensor: torch.Tensor) -> bool:
    """torchao's float8 weight with one scale per row: rows slice with their scales, columns under a whole scale."""
    return (type(tensor).__name__ == "Float8Tensor" and type(tensor).__module__.startswith("torchao")
            and tensor.ndim == 2 and tuple(tensor.scale.shape) == (tensor.shape[0], 1))


def sliceable(tensor: torch.Tensor) -> bool:
    """A quantized weight `unfuse` slices (GGUF bytes on block boundaries, per-row float8)."""
    return gguf_weight(tensor) or per_row_float8(tensor)


def prequantized_model(model: nn.Module) -> bool:
    """A model diffusers loaded pre-quantized in a layout whose Linears the verbs cut (GGUF, BFL fp8r)."""
    quantizer = getattr(model, "hf_quantizer", None)
    return type(quantizer).__name__ in ("GGUFQuantizer", "BFLQuantizer")
