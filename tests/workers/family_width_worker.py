"""What each gloo rank runs for the every-family published-width tier (`tests/families/test_family_width.py`).

`runs(family, cap)` picks, on meta, what runs: published configs cut to one block of each kind, within `cap`
parameters, widest variant first. `run` walks them on every rank of one job:

1. rank 0 alone builds the seeded model (fp32) and computes the single-device fused reference: the output, the input
   gradients and the parameter gradients (in the unfused layout) of a seeded projection of the output, and with
   `half` the output of the same weights in bf16. The other ranks wait, holding nothing.
2. every rank unfuses and shards with `surgery.tensor_parallel(src_data_rank=0)`: rank 0 holds the seeded weights,
   the others uninitialised storage of the model's shapes (`empty_model`; untouched pages cost no memory), which
   rank 0's scatter overwrites shard by shard.
3. rank 0 scatters each reference gradient the way its parameter is placed (`distribute_tensor(src_data_rank=0)`),
   so each rank holds its own chunk and rank 0 drops the whole gradient as it goes.
4. the sharded forward and backward: each parameter's gradient is compared with its chunk the moment it is
   accumulated and both are dropped (`register_post_accumulate_grad_hook`), so no rank ever holds all gradients at
   once; then, with `half`, the sharded model cast to bf16, its forward.

A rank's peak is about two fp32 copies of the model's parameters on rank 0 (weights and reference gradients) and one
on the others (their shards, the gradients' chunks), whatever the number of families: each run frees everything.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import itertools
import math
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import surgery
from surgery.core.build import build, default_dtype, keep_in_fp32
from surgery.core.errors import SurgeryError
from surgery.core.registry import Family, families, model_class
from surgery.parallel.plans import effective_plan, linear_placements

from conformance_worker import floating_inputs, output
from published_width_worker import fast_seeded, reset_peak, status

DEPTH = re.compile(r"(num_|n_)?\w*(layers|blocks)|\w*depth")
PAST = 2**24  # float32 represents every integer up to here, no further: index arithmetic in float32 breaks past it


def one_block_each(family: Family, config: dict) -> dict:
    """`config` with one block of each kind: every integer `*layers` / `*blocks` / `*depth` argument (given or
    defaulted) is 1; a list with one entry per block (HiDream's `llama_layers`) keeps its first entries, a list of
    block indices (SD3.5's `dual_attention_layers`, VACE's `vace_layers`) those below 1."""
    full = {**defaults(family), **config}
    counts = {k: v for k, v in full.items() if DEPTH.fullmatch(k) and type(v) is int and v > 1}
    out = dict(config, **{k: 1 for k in counts})
    blocks = sum(v for k, v in full.items() if k in kinds_of(full))
    kept = sum(out.get(k, full[k]) for k in kinds_of(full))
    for key, value in full.items():
        if DEPTH.fullmatch(key) and isinstance(value, (list, tuple)) and all(type(i) is int for i in value):
            cut = value[:kept] if len(value) == blocks else [i for i in value if i < 1]
            out[key] = type(value)(cut)
    return out


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
                    config = {k: published.get(k, v) if k not in kinds else v for k, v in config.items()}
                    model = on_meta(family, config)
                if model is None:
                    continue
                with torch.device("meta"):
                    fused = {name: p.numel() for name, p in model_class(family)(**config).named_parameters()}
                sizes = cut_sizes(model, fused)
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
    projection = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    (out * projection).sum().backward()
    return out.detach(), {k: kw[k].grad for k in floating_inputs(kw)}


def bf16(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in bfloat16 (the modules diffusers keeps in float32 stay there), as a bf16 checkpoint loads."""
    return keep_in_fp32(model.to(torch.bfloat16))


def reference(family: Family, config: dict, half: bool) -> tuple[torch.nn.Module, dict, dict]:
    """Rank 0: the seeded fused model (fp32, its gradients dropped), what the sharded model is compared with
    (tokens, output, input gradients, bf16 output; each parameter gradient's module scale), and the parameter
    gradients in the unfused layout."""
    model = keep_in_fp32(fast_seeded(family, config, 0, torch.float32))
    ref: dict = {"token_errors": []}
    for tokens in TOKENS:
        try:
            ref["out"], ref["inputs"] = backward(model, inputs_at(family, config, tokens, torch.float32))
        except (RuntimeError, ValueError, AssertionError, IndexError) as error:
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
    if half and "tokens" in ref:
        copy = empty_model(family, config, torch.bfloat16)  # not a deep copy: that would hold a second fp32 model
        whole = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            for name, tensor in [*copy.named_parameters(), *copy.named_buffers()]:
                tensor.copy_(whole[name])
            ref["bf16"] = output(copy, inputs_at(family, config, ref["tokens"], torch.bfloat16))
    return model, ref, grads


def chunks(model: torch.nn.Module, grads: dict, names: list[str], mesh) -> dict[str, torch.Tensor]:
    """Each rank's chunk of rank 0's reference gradient of each parameter in `names`, cut as the parameter is placed
    (whole where it is replicated); rank 0 drops each whole gradient once sent."""
    out = {}
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        local = isinstance(p, DTensor)
        shape, dtype = (p.shape, p.dtype)
        whole = grads.pop(name) if mesh.get_rank() == 0 else torch.empty(shape, dtype=dtype)
        if local:
            out[name] = distribute_tensor(whole, mesh, p.placements, src_data_rank=0).to_local()
        else:
            whole = whole.contiguous()
            dist.broadcast(whole, src=0, group=mesh.get_group())
            out[name] = whole
        del whole
    return out


def compare_as_accumulated(model: torch.nn.Module, ref_chunks: dict, scale: dict,
                           errors: dict[str, float]) -> tuple[dict, dict, list]:
    """Hooks that compare each parameter's gradient with its reference chunk when it is accumulated, then drop both:
    max |gradient - reference| over the module's scale. A gradient still to be summed over the ranks (`Partial`: a
    replicated norm weight inside a sharded attention) is kept for `compare_partial`, after the backward: no
    collective runs inside a hook. Returns `errors` (filled by the backward), the kept gradients and the hooks."""
    partial: dict[str, DTensor] = {}

    def hook(name):
        def compare(p):
            grad, p.grad = p.grad, None
            if isinstance(grad, DTensor) and grad.placements != p.placements:
                partial[name] = grad
                return
            ref = ref_chunks.pop(name, None)
            if ref is None:  # the stock forward does not reach it: the sharded one must not either
                errors[name] = float("inf")
                return
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            errors[name] = max_abs_diff(local, ref) / max(scale[name], 1e-30)
        return compare

    handles = [p.register_post_accumulate_grad_hook(hook(name)) for name, p in model.named_parameters()]
    return errors, partial, handles


def compare_partial(model: torch.nn.Module, partial: dict, ref_chunks: dict, scale: dict, errors: dict) -> None:
    """The kept gradients placed as their parameters (a sum over the ranks), compared as the hooks compare."""
    params = dict(model.named_parameters())
    for name in sorted(partial):  # the same order on every rank: each is a collective
        p = params[name]
        local = partial[name].redistribute(p.device_mesh, p.placements).to_local()
        ref = ref_chunks.pop(name, None)
        errors[name] = float("inf") if ref is None else max_abs_diff(local, ref) / max(scale[name], 1e-30)


def largest_abs(t: torch.Tensor) -> float:
    """max |t| (inf where t holds a NaN: an error, never hidden by a max)."""
    low, high = torch.aminmax(t.detach())
    low, high = low.item(), high.item()
    return float("inf") if math.isnan(low) or math.isnan(high) else max(-low, high)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, step: int = 2**22) -> float:
    """max |a - b| in slices of `step` elements: no temporary the size of a published weight."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return max((largest_abs(a[i:i + step] - b[i:i + step]) for i in range(0, a.numel(), step)), default=0.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return surgery.testing.rel_err(a, b)


def one(rank: int, mesh, family: Family, config: dict, half: bool) -> dict:
    """One model of `family` at `config` sharded over `mesh` against the single-device fused model."""
    laps: list[tuple] = []  # (step, seconds, CPU seconds, resident GB after, peak GB so far): where a run spends

    def lap(step: str, clock=[time.perf_counter(), time.process_time()]) -> None:
        now = [time.perf_counter(), time.process_time()]
        laps.append((step, round(now[0] - clock[0], 1), round(now[1] - clock[1], 1),
                     round(status("VmRSS") / 2**30, 2), round(status("VmHWM") / 2**30, 2)))
        clock[:] = now

    if rank == 0:
        torch.set_num_threads(mesh.size())  # the other ranks wait for this in a collective, idle
        model, ref, grads = reference(family, config, half)
        torch.set_num_threads(1)
    else:
        model, ref, grads = None, None, {}
    box = [ref]
    dist.broadcast_object_list(box, src=0, group=mesh.get_group())
    ref = box[0]
    lap("reference")
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
        r["refused"] = str(error)
        return r
    lap("tp")
    unfused = dict(model.named_parameters())
    cut = {name: n for name, n in fused.items() if name not in unfused}
    cut.update({name: p.numel() for name, p in unfused.items()
                if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)})
    r["largest"], r["largest_name"] = max((n, name) for name, n in cut.items())
    reached = [name for name in unfused if name in ref["scale"]]
    errors = {name: float("inf") for name in ref["scale"] if name not in unfused}  # a reference gradient unmatched
    ref_chunks = chunks(model, grads, reached, mesh)
    del grads, unfused
    lap("chunks")
    errors, partial, handles = compare_as_accumulated(model, ref_chunks, ref["scale"], errors)
    out, inputs = backward(model, inputs_at(family, config, r["tokens"], torch.float32))
    for handle in handles:
        handle.remove()
    compare_partial(model, partial, ref_chunks, ref["scale"], errors)
    del partial
    lap("sharded")
    for name in ref_chunks:  # reached by the stock forward, not by the sharded one
        errors[name] = float("inf")
    worst = max(errors, key=errors.get)
    r.update(forward=rel(out, ref["out"]), grads=errors[worst], worst=worst,
             inputs=max((rel(inputs[k], g) for k, g in ref["inputs"].items()), default=0.0))
    if half:
        with torch.no_grad():
            r["bf16"] = rel(output(bf16(model), inputs_at(family, config, r["tokens"], torch.bfloat16)), ref["bf16"])
    lap("bf16")
    r["laps"] = laps
    return r


def trim() -> None:
    """Hand the heap's free pages back to the kernel: a published block's many freed tensors below glibc's mmap
    threshold otherwise stay resident, and each run would start ~150 MB higher than the last."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def run(rank: int, world: int, plan: list[Run], half: bool) -> list[dict]:
    """Every run of `plan` over all `world` ranks, one after the other; per run also its seconds and this rank's
    peak resident memory (the kernel's VmHWM, reset before the run)."""
    mesh = init_device_mesh("cpu", (world,))
    results = []
    for item in plan:
        base = reset_peak()
        clock = time.perf_counter()
        # no `except` here: a rank that raised and went on would meet the others in the wrong collective. The job
        # ends with the traceback; the line below says which run it reached.
        r = one(rank, mesh, families()[item.family], item.config, half)
        gc.collect()
        trim()
        r.update(seconds=round(time.perf_counter() - clock, 1), peak=status("VmHWM"), base=base)
        results.append(r)
        if rank == 0:
            print(f"family width: {item.family} {item.variant} {item.kinds}: {r}", flush=True)
        dist.barrier()
    return results
