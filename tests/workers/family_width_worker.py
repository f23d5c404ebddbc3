"""What each gloo rank runs for the every-family published-width tier (`tests/families/test_family_width.py`).

`runs(family, cap)` picks, on meta, what runs: published configs cut to one block of each kind, within `cap`
parameters, widest variant first. `run` walks them on every rank of one job:

1. rank 0 alone builds the seeded model (fp32) and computes the single-device fused reference: the output, the input
   gradients and the parameter gradients (in the unfused layout) of a seeded projection of the output, and with
   `half` the output of the same weights in bf16. The parameter gradients go to a file (`torch.save`) and are
   freed. The other ranks wait, holding nothing.
2. every rank unfuses and shards with `surgery.tensor_parallel(src_data_rank=0)`: rank 0 holds the seeded weights
   (the reference's own model), the others uninitialised storage of the model's shapes (`empty_model`; untouched
   pages cost no memory), which rank 0's scatter overwrites shard by shard.
3. the sharded forward and backward: each parameter's gradient is compared, the moment it is accumulated
   (`register_post_accumulate_grad_hook`), with its chunk of the reference read from the file (mapped: only that
   chunk is read), then dropped, so no rank ever holds all gradients at once; then, with `half`, the sharded model
   cast to bf16, its forward.

What a run holds: rank 0, two fp32 copies of the parameters in step 1 (weights and gradients), one and a half in
step 2 (weights and their shards: `tensor_parallel` releases a block's weights once the block is sharded, and these
models are one block); every rank, in steps 2-3, its shards, the replicated parameters whole (the adaptive norms'
modulation Linears: a few hundred M parameters in FLUX-like blocks) and the pages of the reference file it read
(mapped: page cache, which the kernel can drop, but counted in the resident peaks the table shows). Rank 0's peak
(step 1) meets the other ranks idle. Each run frees everything.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import itertools
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import surgery
from surgery.core.build import build, default_dtype, keep_in_fp32
from surgery.core.errors import SurgeryError
from surgery.core.heads_padding import refusal_hint
from surgery.core.registry import Family, families, model_class
from surgery.parallel.plans import effective_plan, linear_placements
from surgery.testing import flex_as

from conformance_worker import floating_inputs, grad_tolerance, output
from published_width_worker import fast_seeded, reset_peak, status

DEPTH = re.compile(r"(num_|n_)?\w*(layers|blocks)|\w*depth")
# a kind of block that comes every n-th block (ConsisID's face cross attention, `num_layers // cross_attn_interval` of
# them): with one block, every block has it; left at 2, one block holds none and the stock forward indexes the first
EVERY = re.compile(r"\w*_interval")
PAST = 2**24  # float32 represents every integer up to here, no further: index arithmetic in float32 breaks past it


def one_block_each(family: Family, config: dict) -> dict:
    """`config` with one block of each kind: every integer `*layers` / `*blocks` / `*depth` / `*_interval` argument
    (given or defaulted) is 1; a list with one entry per block (HiDream's `llama_layers`) keeps its first entries, a list of
    block indices (SD3.5's `dual_attention_layers`, VACE's `vace_layers`) those below 1."""
    full = {**defaults(family), **config}
    counts = {k: v for k, v in full.items() if (DEPTH.fullmatch(k) or EVERY.fullmatch(k)) and type(v) is int and v > 1}
    out = dict(config, **{k: 1 for k in counts})
    blocks = sum(v for k, v in full.items() if k in kinds_of(full))
    kept = sum(out.get(k, full[k]) for k in kinds_of(full))
    for key, value in full.items():
        if DEPTH.fullmatch(key) and isinstance(value, (list, tuple)) and all(type(i) is int for i in value):
            cut = value[:kept] if len(value) == blocks else [i for i in value if i < 1]
            out[key] = type(value)(cut)
    return out


# Arguments that count tokens, not widths: a vocabulary's rows; the positions of a learned positional table, which
# then takes only its own grid (CogVideoX-style: frames, height, width and text length). Kept this small where they
# shape no tensor the run cuts (`few_tokens`).
TOKEN_COUNTS = {"vocab_size": 1024, "max_text_seq_length": 4, "sample_frames": 1, "sample_height": 4, "sample_width": 4}


def few_tokens(family: Family, config: dict) -> dict:
    """`config` with its token counts (`TOKEN_COUNTS`) cut where every tensor the run cuts keeps its published shape:
    Cosmos 3's two vocabulary tables (152 K tokens x 4096, 1245 M parameters, whole on every rank) would keep its one
    block (405 M) out of every run, and ConsisID's learned positional table, at its published grid, makes its run
    17 776 tokens long (750 s where the others take a few)."""
    full = {**defaults(family), **config}
    small = {k: v for k, v in TOKEN_COUNTS.items() if type(full.get(k)) is int and full[k] > v}
    if not small:
        return config

    def cut(config: dict) -> dict[str, tuple] | None:
        model = on_meta(family, config)
        if model is None:
            return None
        with torch.device("meta"):
            fused = dict(model_class(family)(**config).named_parameters())
        shapes = {**{n: tuple(p.shape) for n, p in fused.items()},
                  **{n: tuple(p.shape) for n, p in model.named_parameters()}}
        return {name: shapes[name] for name in cut_sizes(model, {n: p.numel() for n, p in fused.items()})}

    fewer = dict(config, **small)
    return fewer if cut(fewer) == cut(config) is not None else config


def defaults(family: Family) -> dict:
    return {k: p.default for k, p in inspect.signature(model_class(family).__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def kinds_of(config: dict) -> list[str]:
    """The block counts a run may set to 0 to leave that kind of block out (`num_layers`, `num_single_layers`)."""
    return [k for k, v in config.items() if DEPTH.fullmatch(k) and type(v) is int and v > 0
            and k.startswith(("num_", "n_"))]


def on_meta(family: Family, config: dict) -> torch.nn.Module | None:
    """The model on meta, unfused; None where the class refuses the config (a kind of block it cannot do without).
    Not `model_on_meta`: it refuses a count of 0, which the model classes take."""
    try:
        with torch.device("meta"):
            model = build(family, config)
    except (TypeError, ValueError, ZeroDivisionError, RuntimeError, IndexError, AttributeError, AssertionError):
        return None
    return surgery.unfuse(model)


def cut_sizes(model: torch.nn.Module, fused: dict[str, int]) -> dict[str, int]:
    """Elements of each tensor the run cuts: the fused parameters `unfuse` sliced (in `fused`, gone from `model`)
    and the parameters the model's plan shards."""
    sizes = {name: n for name, n in fused.items() if name not in dict(model.named_parameters())}
    for path, style in effective_plan(model).items():
        module = model.get_submodule(path)
        for leaf, placement in (linear_placements(style, module) or {}).items():
            param = getattr(module, leaf, None)
            if isinstance(param, torch.nn.Parameter) and placement[0].is_shard():
                sizes[f"{path}.{leaf}"] = param.numel()
    return sizes


@dataclass(frozen=True)
class Run:
    """One model of a family's published width: `kinds` the block counts left at 1 (the others 0)."""
    family: str
    variant: str
    config: dict
    kinds: tuple[str, ...]
    parameters: int
    largest_cut: int  # elements of the largest tensor the run cuts (counted on meta)


def candidates(family: Family) -> list[tuple[int, Run]]:
    """(the variant's largest cut tensor with every kind of block, a run) for every published variant and every
    non-empty set of its kinds of block (the others 0), counted on meta."""
    out = []
    for variant in family.variants:
        base = one_block_each(family, family.config(variant))
        kinds = kinds_of({**defaults(family), **base})
        width = None
        for n in range(len(kinds), 0, -1) if kinds else [0]:
            for kept in itertools.combinations(kinds, n):
                config = dict(base, **{k: 0 for k in kinds if k not in kept})
                model = on_meta(family, config)
                if model is None:  # a count the class constrains (ConsisID's `LFE_depth`): the published one
                    published = {**defaults(family), **family.config(variant)}
                    config = {k: v if k in kinds or EVERY.fullmatch(k) else published.get(k, v)
                              for k, v in config.items()}
                    model = on_meta(family, config)
                if model is None:
                    continue
                fewer = few_tokens(family, config)
                if fewer is not config:
                    config, model = fewer, on_meta(family, fewer)
                with torch.device("meta"):
                    fused = {name: p.numel() for name, p in model_class(family)(**config).named_parameters()}
                sizes = cut_sizes(model, fused)
                if n < len(kinds) and sizes and not reaches(family, config, max(sizes, key=sizes.get)):
                    continue  # Kandinsky 6's text blocks feed only its visual blocks: alone they prove nothing
                run = Run(family.name, variant, config, kept, sum(p.numel() for p in model.parameters()),
                          max(sizes.values(), default=0))
                width = run.largest_cut if width is None else width  # every kind: the first that builds
                out.append((width, run))
    return out


def runs(family: Family, cap: int) -> tuple[list[Run], int, set[str]]:
    """What runs of `family` within `cap` parameters per model, the largest cut tensor of any published variant
    (one block of each kind, no cap), and the kinds of block no run holds. Each kind of block runs in the widest variant where a model holding it fits
    `cap`, as many kinds per model as fit: one model where all fit, else one per kind or group of kinds. A kind
    whose one block exceeds `cap` in every variant is left out."""
    found = candidates(family)
    published = max((run.largest_cut for _, run in found), default=0)
    fitting = [(width, run) for width, run in found if run.parameters <= cap and run.largest_cut]
    left = kinds_cut(found)
    chosen = []
    while True:
        options = [(width, len(left & set(run.kinds)), -run.parameters, run) for width, run in fitting
                   if left & set(run.kinds) or (not chosen and not run.kinds)]
        if not options:
            return chosen, published, left
        *_, best = max(options, key=lambda o: o[:3])
        chosen.append(best)
        left -= set(best.kinds)
        if not left:
            return chosen, published, left


def reaches(family: Family, config: dict, name: str) -> bool:
    """Whether the stock output depends on parameter `name` (fused, or the fused owner of an unfused part): a meta
    forward and backward of the family's example inputs gives it a gradient. True where the forward cannot run on
    meta (the run itself then checks, `largest_reached`)."""
    with torch.device("meta"):
        model = model_class(family)(**config)
    params = dict(model.named_parameters())
    owner = name.rpartition(".")[0]
    target = [p for n, p in params.items() if n == name or n.rpartition(".")[0] == owner.rpartition(".")[0]]
    try:
        out = output(model, family.example_inputs(config, batch=1, image_tokens=4, text_tokens=4, device="meta"))
        out.float().sum().backward()
    except Exception:  # noqa: BLE001 - any forward meta cannot run: the real run checks
        return True
    return any(p.grad is not None for p in target)


def kinds_cut(found: list[tuple[int, Run]]) -> set[str]:
    """The kinds of block whose one block holds a tensor the run cuts (Krea2's text-fusion blocks, replicated, do
    not): a kind whose model without the others cuts nothing needs no run of its own."""
    alone = {run.kinds[0]: run.largest_cut for _, run in found if len(run.kinds) == 1}
    return {k for _, run in found for k in run.kinds if alone.get(k, 1)}


# --- what each rank runs ------------------------------------------------------------------------------------------

def empty_model(family: Family, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The model with uninitialised parameters (buffers computed as usual): what a rank holds that
    `tensor_parallel(src_data_rank=0)` fills from rank 0. Untouched pages cost no memory."""
    from accelerate import init_empty_weights

    with default_dtype(dtype), init_empty_weights():
        model = build(family, config)
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf,
                torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=True))
    return loaded_as(model, dtype)


def loaded_as(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """As `from_pretrained(torch_dtype=...)` loads it (and `seeded_model`): persistent floating buffers in `dtype`,
    those a constructor makes in another whatever the default (OmniGen's float32 `pos_embed`, ConsisID's float64
    `pos_embedding`) too; the modules diffusers keeps in float32 there."""
    persistent = model.state_dict(keep_vars=True)
    for name, buffer in list(model.named_buffers()):
        if name in persistent and buffer.is_floating_point() and buffer.dtype != dtype:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, buffer.to(dtype))
    return keep_in_fp32(model).eval()


# The fewest tokens first; the next where a model needs a grid of more. Text: 4 tokens, the last one padding in the
# families' example inputs: with a single valid key a cross attention's softmax is constant, so its q/k (and their
# norms') gradients are exactly zero and a relative error of them is rounding noise (Bria-Fibo 2's Perceiver read
# 1.51 "off" at 2 text tokens; 0.0 on both sides at any width when computed exactly).
TOKENS = ((4, 4), (16, 8))


def inputs_at(family: Family, config: dict, tokens: tuple, dtype: torch.dtype) -> dict:
    return family.example_inputs(config, batch=1, image_tokens=tokens[0], text_tokens=tokens[1], seed=0, dtype=dtype)


def backward(model, kw: dict) -> tuple[torch.Tensor, dict]:
    """The output and the inputs' gradients of a seeded projection of it (parameters' gradients: their `.grad`, or
    what their hooks do with them)."""
    kw = {k: v.detach().clone().requires_grad_(True) if k in floating_inputs(kw) else v for k, v in kw.items()}
    out = output(model, kw)
    # drawn in float32 whatever the output's dtype: a float64 run (`float64_errors`) is projected on the same vector
    projection = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    (out * projection).sum().backward()
    return out.detach(), {k: kw[k].grad for k in floating_inputs(kw)}


def non_persistent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s floating buffers no checkpoint holds (`persistent=False`: rotary frequency tables, blur kernels)."""
    persistent = model.state_dict(keep_vars=True)
    return {name: b for name, b in model.named_buffers() if name not in persistent and b.is_floating_point()}


def bf16(model: torch.nn.Module, family: Family, config: dict) -> torch.nn.Module:
    """`model` in bfloat16 as `from_pretrained(torch_dtype=torch.bfloat16)` loads it: parameters and persistent
    buffers in bf16, the modules diffusers keeps in float32 there (`keep_in_fp32`), and the buffers no checkpoint
    holds as the constructor makes them under that default dtype, not cast: `.to(torch.bfloat16)` would round
    Ideogram 4's float32 rotary `inv_freq` too, and its image positions (offset 65536) with it (0.12 of the output
    against the model as loaded). A buffer the rewrites reshaped is cast."""
    from accelerate import init_empty_weights

    with default_dtype(torch.bfloat16), init_empty_weights():  # parameters on meta, buffers computed
        built = non_persistent(build(family, config))
    own = non_persistent(model)
    model.to(torch.bfloat16)
    for name, buffer in own.items():
        value = built.get(name)
        if value is not None and value.shape == buffer.shape:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, value)
    return keep_in_fp32(model)


def reference(family: Family, config: dict, half: bool, folder: str) -> tuple[torch.nn.Module, dict]:
    """Rank 0: the seeded fused model (fp32, its gradients dropped) and what the sharded model is compared with:
    tokens, output, input gradients, bf16 output, each parameter gradient's module scale. The parameter gradients,
    in the unfused layout, go to `folder`/grads.pt and are freed: every rank reads its chunks from there (mapped, a
    parameter at a time), so no rank holds weights, gradients and shards together."""
    model = loaded_as(fast_seeded(family, config, 0, torch.float32), torch.float32)
    ref: dict = {"token_errors": []}
    for tokens in TOKENS:
        try:
            ref["out"], ref["inputs"] = backward(model, inputs_at(family, config, tokens, torch.float32))
        # NameError: a module diffusers imports only where installed (Cosmos's padding mask is resized by torchvision's
        # `transforms`): stock itself cannot run, the test says why. KeyError: features the inputs lack (RFD4's
        # `token_type` did, before its example inputs gave the released features theirs): a failed test, not a dead job
        except (RuntimeError, ValueError, AssertionError, IndexError, NameError, KeyError) as error:
            ref["token_errors"].append(f"{tokens}: {str(error).splitlines()[0][:120]}")
            model.zero_grad(set_to_none=True)
            continue
        ref["tokens"] = tokens
        break
    # a parameter the stock forward does not reach (JoyImage's last text stream) has no gradient, here or sharded
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    slices = [s for s in surgery.state_dict.weight_slices(model) if s.fused in grads]
    grads = surgery.state_dict.unfuse_state_dict(grads, slices) if slices else grads
    scale: dict[str, float] = {}  # a gradient's error is measured on the largest gradient of its module
    for name, g in grads.items():
        module = name.rpartition(".")[0]
        scale[module] = max(scale.get(module, 0.0), largest_abs(g))
    ref["scale"] = {name: scale[name.rpartition(".")[0]] for name in grads}
    # the parts `unfuse` slices each fused parameter into, which may take other names than the fused module's
    # (NucleusMoE's `net.0.proj` -> `net.0.proj_gate`, `net.0.proj_up`)
    ref["parts"] = {}
    for s in surgery.state_dict.weight_slices(model):
        ref["parts"].setdefault(s.fused, []).append(s.unfused)
    torch.save({name: g.contiguous() for name, g in grads.items()}, os.path.join(folder, "grads.pt"))
    del grads
    if half and "tokens" in ref:
        copy = empty_model(family, config, torch.bfloat16)  # not a deep copy: that would hold a second fp32 model
        whole = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        persistent = copy.state_dict(keep_vars=True)
        with torch.no_grad():  # what a checkpoint holds; the buffers it does not, as constructed in bf16 (`bf16`)
            for name, tensor in [*copy.named_parameters(),
                                 *((n, b) for n, b in copy.named_buffers() if n in persistent)]:
                tensor.copy_(whole[name])
            ref["bf16"] = output(copy, inputs_at(family, config, ref["tokens"], torch.bfloat16))
    return model, ref


def local_chunk(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The part of `whole` that parameter `p` holds on this rank: DTensor's cut on a one-dimensional mesh (torch.chunk
    along the sharded dimension), or all of it where `p` is replicated; only that part is read. Where `p` holds zero
    heads past the model's (`pad_heads`: rows or columns of zeros at the end), `whole` with zeros there: their
    gradients must be zero."""
    if tuple(whole.shape) != tuple(p.shape):
        whole = torch.nn.functional.pad(whole, [x for d in reversed(range(whole.dim()))
                                                for x in (0, p.shape[d] - whole.shape[d])])
    if not isinstance(p, DTensor) or not p.placements[0].is_shard():
        return whole
    mesh = p.device_mesh
    return whole.chunk(mesh.size(), p.placements[0].dim)[mesh.get_local_rank()]


def compare_as_accumulated(model: torch.nn.Module, grads: dict, scale: dict, errors: dict[str, float],
                           bound: float, kept: dict) -> tuple[dict, dict, list]:
    """Hooks that compare each parameter's gradient with its chunk of the reference `grads` (mapped from rank 0's
    file) when it is accumulated, then drop it: max |gradient - reference| over the module's scale. A gradient still
    to be summed over the ranks (`Partial`: a replicated norm weight inside a sharded attention) is kept for
    `compare_partial`, after the backward: no collective runs inside a hook. A gradient further than `bound` from
    the reference goes into `kept` (this rank's part), for `float64_errors`. Returns `errors` (filled by the
    backward), the gradients still to sum and the hooks."""
    partial: dict[str, DTensor] = {}

    def hook(name):
        def compare(p):
            grad, p.grad = p.grad, None
            if isinstance(grad, DTensor) and grad.placements != p.placements:
                partial[name] = grad
                return
            errors[name] = error_of(grad, p, grads.pop(name, None), scale.get(name))
            keep(name, grad, errors[name], bound, kept)
        return compare

    handles = [p.register_post_accumulate_grad_hook(hook(name)) for name, p in model.named_parameters()]
    return errors, partial, handles


def error_of(grad: torch.Tensor, p: torch.Tensor, whole: torch.Tensor | None, scale: float | None) -> float:
    """A sharded gradient against its chunk of the reference; inf where the stock forward gives it none."""
    if whole is None:  # the stock forward does not reach it: the sharded one must not either
        return float("inf")
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    return max_abs_diff(local, local_chunk(whole, p)) / max(scale, 1e-30)


def keep(name: str, grad: torch.Tensor, error: float, bound: float, kept: dict) -> None:
    """This rank's part of a gradient past `bound` (a finite distance: a gradient missing on either side is no
    rounding, and fails)."""
    if bound < error < float("inf"):
        kept[name] = grad.to_local() if isinstance(grad, DTensor) else grad


def compare_partial(model: torch.nn.Module, partial: dict, grads: dict, scale: dict, errors: dict, bound: float,
                    kept: dict) -> None:
    """The gradients still to sum placed as their parameters (a sum over the ranks), compared as the hooks
    compare."""
    params = dict(model.named_parameters())
    for name in sorted(partial):  # the same order on every rank: each is a collective
        p = params[name]
        grad = partial[name].redistribute(p.device_mesh, p.placements)
        errors[name] = error_of(grad, p, grads.pop(name, None), scale.get(name))
        keep(name, grad, errors[name], bound, kept)


def float64_errors(rank: int, mesh, family: Family, config: dict, ref: dict, past: list, kept: dict,
                   inputs: dict, model: torch.nn.Module) -> dict[str, float]:
    """Where a gradient is past the bound, how far this rank's sharded gradients and the stock float32 ones are
    from the single-device model computed in float64 (as the conformance suite's `float64_errors`): an
    ill-conditioned gradient carries more float32 rounding than the bound in the stock model itself, and the sharded
    one passes within `ROUNDING_SPREAD` times stock's distance (the test checks). Rank 0 computes the float64 gradients of the
    parameters any rank kept (only those: the model's weights in float64, not their gradients) and of the inputs,
    into a file each rank reads its part of."""
    names = sorted({n for kept_names, _ in past for n in kept_names})
    path = os.path.join(ref["folder"], "float64.pt")
    if rank == 0:
        seeded = loaded_as(fast_seeded(family, config, 0, torch.float32), torch.float32)
        owners = {part: fused for fused, parts in ref["parts"].items() for part in parts}
        wanted = {owners.get(n, n) for n in names}
        for name in [n for n, _ in seeded.named_parameters()]:  # one at a time: float64 and float32 never both whole
            owner, _, leaf = name.rpartition(".")
            p = seeded.get_parameter(name)
            setattr(seeded.get_submodule(owner), leaf,
                    torch.nn.Parameter(p.detach().double(), requires_grad=name in wanted))
            del p
        seeded.double()  # the buffers
        kw = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs_at(family, config, ref["tokens"], torch.float32).items()}
        _, inputs64 = backward(seeded, kw)
        grads = {n: p.grad for n, p in seeded.named_parameters() if p.grad is not None}
        slices = [s for s in surgery.state_dict.weight_slices(seeded) if s.fused in grads]
        grads = surgery.state_dict.unfuse_state_dict(grads, slices) if slices else grads
        torch.save({"params": {n: grads[n].contiguous() for n in names}, "inputs": inputs64}, path)
        del seeded, grads
    dist.barrier(group=mesh.get_group())
    f64 = torch.load(path, mmap=True, weights_only=True)
    stock = torch.load(os.path.join(ref["folder"], "grads.pt"), mmap=True, weights_only=True)
    params = dict(model.named_parameters())
    sharded, stocks = [0.0], [0.0]
    for name, grad in kept.items():
        whole = local_chunk(f64["params"][name], params[name])
        scale = max(ref["scale"][name], 1e-30)
        sharded.append(max_abs_diff(grad.double(), whole) / scale)
        stocks.append(max_abs_diff(local_chunk(stock[name], params[name]).double(), whole) / scale)
    if past[rank][1]:
        for k, g in f64["inputs"].items():
            sharded.append(input_error(None if inputs[k] is None else inputs[k].double(), g))
            stocks.append(input_error(None if ref["inputs"][k] is None else ref["inputs"][k].double(), g))
    dist.barrier(group=mesh.get_group())  # every rank has read the file before the next run replaces it
    return {"sharded": max(sharded), "stock": max(stocks), "names": sorted(kept)}


def largest_abs(t: torch.Tensor) -> float:
    """max |t| (inf where t holds a NaN: an error, never hidden by a max); 0 for an empty tensor."""
    if t.numel() == 0:
        return 0.0
    low, high = torch.aminmax(t.detach())
    low, high = low.item(), high.item()
    return float("inf") if math.isnan(low) or math.isnan(high) else max(-low, high)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, step: int = 2**22) -> float:
    """max |a - b| in slices of `step` elements: no temporary the size of a published weight."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return max((largest_abs(a[i:i + step] - b[i:i + step]) for i in range(0, a.numel(), step)), default=0.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return surgery.testing.rel_err(a, b)


def input_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """An input's gradient against the reference's; an input the output does not depend on (Kandinsky 6's audio
    when its model holds only text blocks) has none on either side, and must have none on both."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    if want.numel() == 0:  # an empty input (Krea2's): nothing to differ, but the same shape
        return 0.0 if got.shape == want.shape else float("inf")
    return rel(got, want)


def one(rank: int, meshes: list, family: Family, config: dict, half: bool) -> dict[int, dict]:
    """One model of `family` at `config` against the single-device fused model, sharded over each of `meshes` in
    turn (the first n ranks each) from the one reference: {mesh size: this rank's results} for the meshes that hold
    this rank."""
    laps: list[tuple] = []  # (step, seconds, CPU seconds, resident GB after, peak GB so far): where a run spends

    def lap(step: str, clock=[time.perf_counter(), time.process_time()]) -> None:
        now = [time.perf_counter(), time.process_time()]
        laps.append((step, round(now[0] - clock[0], 1), round(now[1] - clock[1], 1),
                     round(status("VmRSS") / 2**30, 2), round(status("VmHWM") / 2**30, 2)))
        clock[:] = now

    # the reference gradients in memory where the system has a tmpfs: written to disk, a published block's GB of
    # them cost ~9 of a run's ~12 s (AuraFlow, 548 M parameters); the pages count as this rank's resident memory
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    folder = tempfile.mkdtemp(prefix="surgery-width-", dir=shm) if rank == 0 else None
    if rank == 0:
        torch.set_num_threads(min(dist.get_world_size(), os.cpu_count() or 1))  # the other ranks wait, idle
        model, ref = reference(family, config, half, folder)
        ref["folder"] = folder
        torch.set_num_threads(1)
    else:
        model, ref = None, None
    box = [ref]
    dist.broadcast_object_list(box, src=0)
    ref = box[0]
    lap("reference")
    out = {}
    try:
        for mesh in meshes:
            if rank < mesh.size():
                if rank == 0 and model is None:  # the reference's own model went to the last mesh: the same again
                    model = loaded_as(fast_seeded(family, config, 0, torch.float32), torch.float32)
                out[mesh.size()] = sharded(rank, mesh, family, config, half, model, ref, lap, laps)
                model = None
                gc.collect()
            dist.barrier()  # the ranks past this mesh wait here, holding nothing
    finally:
        dist.barrier()  # every rank has closed the file
        if rank == 0:
            shutil.rmtree(folder)
    return out


def sharded(rank: int, mesh, family: Family, config: dict, half: bool, model, ref: dict, lap, laps: list) -> dict:
    """Every rank: the model sharded from rank 0's weights, its forward and backward against `ref`."""
    r: dict = {"token_errors": ref["token_errors"]}
    if "tokens" not in ref:
        return r
    r["tokens"] = ref["tokens"]
    if rank:
        model = empty_model(family, config, torch.float32)
    fused = {name: p.numel() for name, p in model.named_parameters()}
    r["parameters"] = sum(fused.values())
    lap("empty")
    surgery.unfuse(model)
    lap("unfuse")
    try:
        surgery.tensor_parallel(model, mesh, src_data_rank=0)
    except SurgeryError as error:  # raised on every rank at once, before anything changed
        if refusal_hint(mesh.size()).strip(", ") not in str(error):
            r["refused"] = str(error)
            return r
        # heads the mesh does not divide (Z-Image's 30 over 4): padded with zero heads, as the refusal offers
        surgery.tensor_parallel(model, mesh, src_data_rank=0, pad_heads=True)
        r["zero_heads"] = True
    lap("tp")
    unfused = dict(model.named_parameters())
    cut = {name: n for name, n in fused.items() if name not in unfused}
    cut.update({name: p.numel() for name, p in unfused.items()
                if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)})
    r["largest"], r["largest_name"] = max((n, name) for name, n in cut.items())
    # the largest cut tensor the stock output depends on (a reference gradient for it or, fused, for its parts): a
    # run whose blocks the output does not depend on (Kandinsky 6's text blocks without a visual block) proves
    # nothing; one block's last text stream may go unused (EasyAnimate's `txt_ff`), the rest of the block not
    def reached(name: str) -> bool:
        owner = name.rpartition(".")[0] + "."
        return any(n == name or n.startswith(owner) or n in ref["parts"].get(name, ()) for n in ref["scale"])

    r["largest_reached"] = max((n for name, n in cut.items() if reached(name)), default=0)
    # a reference gradient no parameter matches
    errors = {name: float("inf") for name in ref["scale"] if name not in unfused}
    del unfused
    grads = torch.load(os.path.join(ref["folder"], "grads.pt"), mmap=True, weights_only=True)
    bound, kept = grad_tolerance(family), {}
    errors, partial, handles = compare_as_accumulated(model, grads, ref["scale"], errors, bound, kept)
    kw = inputs_at(family, config, r["tokens"], torch.float32)
    try:
        out, inputs = backward(model, kw)
    except RuntimeError as error:  # raised by every rank at the same op: no collective is left unmatched
        if "is a view and is being modified inplace" not in str(error):
            raise
        # torch's refusal of an in-place write into a view under autograd (CogVideoX-5b's RoPE into the per-head
        # norm's output, tests/families/test_cogvideox.py): the test accepts it where the family says so
        r["autograd_refused"] = str(error).splitlines()[0][:200]
        with torch.no_grad():
            out = output(model, kw)
        r.update(forward=rel(out, ref["out"]))
    for handle in handles:
        handle.remove()
    if "autograd_refused" not in r:
        compare_partial(model, partial, grads, ref["scale"], errors, bound, kept)
        for name in grads:  # reached by the stock forward, not by the sharded one
            errors[name] = float("inf")
        worst = max(errors, key=errors.get)
        r.update(forward=rel(out, ref["out"]), grads=errors[worst], worst=worst,
                 inputs=max((input_error(inputs[k], g) for k, g in ref["inputs"].items()), default=0.0))
        past = [None] * mesh.size()  # every rank of the mesh learns what any rank found past the bound
        dist.all_gather_object(past, (sorted(kept), r["inputs"] > bound), group=mesh.get_group())
        if any(names or ins for names, ins in past):
            r["float64"] = float64_errors(rank, mesh, family, config, ref, past, kept, inputs, model)
    del partial, grads, kept
    lap("sharded")
    if half:
        with torch.no_grad():
            half_model = bf16(model, family, config)
            r["bf16"] = rel(output(half_model, inputs_at(family, config, r["tokens"], torch.bfloat16)), ref["bf16"])
    lap("bf16")
    r["laps"] = list(laps)
    return r


def trim() -> None:
    """Hand the heap's free pages back to the kernel: a published block's many freed tensors below glibc's mmap
    threshold otherwise stay resident, and each run would start ~150 MB higher than the last."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


WORLDS = (2, 4)  # each run is sharded over the first 2 ranks, then over 4, from one reference


def run(rank: int, world: int, plan: list[Run], half: bool) -> list[dict[int, dict]]:
    """Every run of `plan`, one after the other, at each world of `WORLDS` up to `world` ({world: results}); per run
    also its seconds (the reference and every world) and this rank's peak resident memory over the run (the
    kernel's VmHWM, reset before it)."""
    meshes = [DeviceMesh("cpu", list(range(n))) for n in WORLDS if n <= world]
    results = []
    for item in plan:
        base = reset_peak()
        clock = time.perf_counter()
        # no `except` here: a rank that raised and went on would meet the others in the wrong collective. The job
        # ends with the traceback; the line below says which run it reached.
        family = families()[item.family]
        with flex_as(family.tests.flex_backward):  # flex attention has no backward on CPU: its mask made dense
            by_world = one(rank, meshes, family, item.config, half)
        gc.collect()
        trim()
        for r in by_world.values():
            r.update(seconds=round(time.perf_counter() - clock, 1), peak=status("VmHWM"), base=base)
        results.append(by_world)
        if rank == 0:
            print(f"family width: {item.family} {item.variant} {item.kinds}: {by_world}", flush=True)
        dist.barrier()
    return results


def markdown(table: dict, cap: int) -> str:
    """docs/width.md from the recorded runs (`test_family_width.record`): one row per run."""
    def cell(row: dict, world: int, key: str) -> str:
        r = row.get(f"w{world}")
        if r is None:
            return "—"
        if key == "grads" and r["grads"] is None:
            return "autograd refused by torch"
        value = max(r["grads"], r["inputs"]) if key == "grads" else r[key]
        if key == "forward" and r.get("zero_heads"):  # heads the mesh does not divide, padded (`pad_heads`)
            return f"{r['forward']:.1e} (zero heads)"
        if key == "grads" and "float64" in r:  # past the bound: both against float64 (`float64_errors`)
            return f"{value:.1e} (float64: {r['float64']['sharded']:.1e}, stock {r['float64']['stock']:.1e})"
        return {"seconds": f"{value:.0f}", "peak_gb": f"{value:.1f}"}.get(key, f"{value:.1e}")

    lines = [
        "# Every family at its published width",
        "",
        "Generated by `SURGERY_WIDTH_RECORD=1 python -m pytest -q tests/families/test_family_width.py -m width` "
        "(`tests/families/test_family_width.py`); do not edit by hand.",
        "",
        f"Each run: the widest published config of the family cut to one block of each kind (one model per kind where "
        f"all together exceed {cap / 1e6:.0f} M parameters), sharded by `surgery.tensor_parallel` over gloo ranks "
        "against the single-device fused model, seeded weights, 4 image and 4 text tokens. fwd: max relative error "
        "of the fp32 output (\"zero heads\": the mesh does not divide the heads, sharded with `pad_heads=True` as the "
        "refusal offers, the zero heads' gradients held to zero); largest cut: elements of the largest tensor the run cuts whose gradient the output "
        "depends on (past 2**24 = 16.8 M where a published model's is); grad: the worst parameter gradient (max abs difference over its module's largest "
        "gradient) or input gradient, and where that is past the bound, how far the sharded and the stock float32 "
        "gradients are from the model computed in float64 (the sharded ones within twice stock's distance); bf16: the sharded "
        "model cast to bf16 against the whole one cast to bf16. Each run computes the single-device reference once, "
        "then shards over 2 ranks, then over 4: s, the run's seconds, all of it; GB, the 4 ranks' resident peaks "
        "over the run, summed (the reference gradients' pages, shared in memory, count once in every rank that reads "
        "them: more than the machine holds at once).",
        "",
        "| family | variant | blocks | parameters | largest cut | w2 fwd | w2 grad | w2 bf16 | w4 fwd | w4 grad "
        "| w4 bf16 | s | GB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table.values():
        largest = (row.get("w2") or row.get("w4"))["largest"]
        lines.append(f"| {row['family']} | {row['variant']} | {row['kinds']} | {row['parameters'] / 1e6:.0f} M "
                     f"| {largest / 1e6:.1f} M | " + " | ".join(cell(row, w, k) for w in (2, 4)
                                                          for k in ("forward", "grads", "bf16"))
                     + f" | {cell(row, 4, 'seconds')} | {cell(row, 4, 'peak_gb')} |")
    worst = {f"w{w} {k}": max((max(r[f"w{w}"][k], r[f"w{w}"]["inputs"]) if k == "grads" else r[f"w{w}"][k])
                              for r in table.values() if r.get(f"w{w}") and r[f"w{w}"][k] is not None)
             for w in (2, 4) for k in ("forward", "grads", "bf16") if any(f"w{w}" in r for r in table.values())}
    lines += ["", "Worst over the table: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + "."]
    done = [r["w4"] for r in table.values() if r.get("w4")]
    if done:
        lines.append(f"{len(done)} runs, {sum(r['seconds'] for r in done):.0f} s of runs in all (each run's seconds, "
                     f"without the jobs' start), the largest resident peak summed over the ranks "
                     f"{max(r['peak_gb'] for r in done):.1f} GB.")
    lines.append("")
    return "\n".join(lines)
