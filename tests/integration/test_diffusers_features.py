"""diffusers' own features on the unfused model, for every registered family: same modules touched, same outputs.

Each test runs the feature on the stock (fused) model first; where stock diffusers refuses it, the test is skipped
with stock's own reason. Otherwise the unfused copy (`surgery.unfuse`) must accept the feature, touch the same
modules (compiled regions, hooked modules, no-split groups, processors) and give the stock model's outputs
(fp32 <= 1e-5, over a few denoising-like calls where the feature keeps state). A family registered later gets these
tests with no edit (the cases come from `surgery.extend.families()`). Plans-only families (nothing to unfuse) are skipped:
comparing a model with its own copy proves nothing.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import conformance_worker as W
import features_tp_worker as TPW
import surgery
from surgery.testing import rel_err, run_on_cpu_ranks

TOL = W.FP32_TOL
CASES = [(f.name, next(iter(f.tests.configs))) for f in W.conformant_families()]
IDS = [name for name, _ in CASES]
TURN = {name: i for i, (name, _) in enumerate(CASES)}


def heavy_in_turn(family_name: str, kinds: list[str], kind: str) -> bool:
    """Where a feature comes in kinds (caches, skips, hooks under TP), the default tier runs each family with one kind,
    in turn: every family under one, every kind on 1/len(kinds) of the families; the heavy tier runs the rest."""
    return kinds.index(kind) != TURN[family_name] % len(kinds)


def in_turn(kinds: list[str]) -> list:
    """(family, config, kind) cases, marked heavy where `heavy_in_turn`."""
    return [pytest.param(n, c, k, id=f"{n}-{k}", marks=[pytest.mark.heavy] if heavy_in_turn(n, kinds, k) else [])
            for n, c in CASES for k in kinds]


def build(family_name: str, config_name: str, seed: int = 0):
    family, config, stock = W.make(family_name, config_name, seed)
    if not family.rewrites:
        pytest.skip(f"{family_name} is a plans-only family: unfuse changes no module, nothing to compare")
    return family, config, stock, surgery.unfuse(copy.deepcopy(stock))


def on_stock(what: str, fn, model):
    """Run `fn(model)` on the stock model; a refusal there skips the test with stock's reason.

    Only diffusers' (or torch's) own refusal: an assertion, or an error raised in this test's own code, fails."""
    try:
        return fn(model)
    except AssertionError:
        raise
    except Exception as error:  # noqa: BLE001 - a refusal of stock diffusers is a skip reason, checked below
        frame = error.__traceback__
        while frame.tb_next is not None:
            frame = frame.tb_next
        # a call's TypeError names the callee it is raised for: diffusers' own function refusing its arguments
        # (HunyuanImage passes attention_mask= to its gradient-checkpointing function, which takes no keywords)
        on_behalf_of_diffusers = isinstance(error, TypeError) and "ModelMixin." in str(error)
        if os.path.abspath(frame.tb_frame.f_code.co_filename).startswith(_HERE) and not on_behalf_of_diffusers:
            raise  # the test's own mistake, not stock's refusal
        pytest.skip(f"stock {type(model).__name__} refuses {what}: {type(error).__name__}: {str(error)[:200]}")


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # tests/: the tests' own code


def test_on_stock_skips_for_stock_refusals_only():
    _, _, stock = W.make("flux2", next(iter(surgery.extend.families()["flux2"].tests.configs)))

    def outcome(fn) -> str:
        try:
            on_stock("a feature", fn, stock)
        except pytest.skip.Exception as skipped:  # caught here: a skip must not skip this test itself
            return f"skipped: {skipped}"
        except BaseException as error:  # noqa: BLE001 - which exception came out is the result
            return type(error).__name__
        return "ran"

    def own_mistake(model):
        raise KeyError("a mistake of the test's own")

    assert outcome(own_mistake) == "KeyError"
    assert outcome(lambda m: assert_same_outputs([torch.ones(1)], [torch.zeros(1)])) == "AssertionError"
    # diffusers' own refusal
    assert outcome(lambda m: m.enable_cache(object())).startswith(
        "skipped: stock Flux2Transformer2DModel refuses a feature: ValueError")


def steps(family, config, n: int = 4):
    """Keyword arguments of `n` denoising-like calls: the latents drift, the timestep falls."""
    kw = W.inputs(family, config, 0)
    # the latents: `hidden_states`, Z-Image's `x` or Cosmos 3's `vision_tokens` (lists, one latent per item),
    # T5FilmDecoder's `decoder_input_tokens`, MiniMax Music 3's depth decoder's `inputs_embeds` or RFD4's backbone
    # `bb_ca`; the timestep: `timestep`, `t`, `decoder_noise_time`, `vision_timesteps` or `bb_ca_time`
    latent = next(k for k in ("hidden_states", "x", "vision_tokens", "decoder_input_tokens", "inputs_embeds", "bb_ca")
                  if k in kw)
    time = next((k for k in ("timestep", "t", "decoder_noise_time", "vision_timesteps", "bb_ca_time") if k in kw),
                None)
    latents = kw[latent] if isinstance(kw[latent], list) else [kw[latent]]
    generator = torch.Generator().manual_seed(7)
    noise = [torch.randn(x.shape, generator=generator) for x in latents]
    for i in range(n):
        step = dict(kw)
        drifted = [x + 0.05 * i * z for x, z in zip(latents, noise)]
        step[latent] = drifted if isinstance(kw[latent], list) else drifted[0]
        if isinstance(kw.get(time), torch.Tensor):
            step[time] = kw[time] * (1.0 - 0.15 * i)
        yield step


def run(model, family, config, n: int = 4, context: str | None = None) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for kw in steps(family, config, n):
            if context is None:
                outs.append(W.output(model, kw))
            else:
                with model.cache_context(context):
                    outs.append(W.output(model, kw))
    return outs


def assert_same_outputs(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float = TOL) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        error = rel_err(g, r)
        assert error <= tol, f"call {i}: unfused vs stock relative error {error:.3g} > {tol}"


def hooked(model) -> dict[str, list[str]]:
    """Module path -> names of the diffusers hooks registered on it."""
    return {name: sorted(m._diffusers_hook.hooks) for name, m in model.named_modules()
            if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.hooks}


def stock_names(unfused, names) -> set[str]:
    """The stock modules whose parameters the unfused modules `names` hold (through the slice tables); a module
    that holds no sliced parameter keeps its own path. For features that hook each leaf (leaf-level offloading), the
    unfused model's leaves are finer than stock's by construction."""
    to_fused = {s.unfused: s.fused for s in surgery.state_dict.weight_slices(unfused)}
    out = set()
    for name in names:
        keys = [f"{name}.{p}" if name else p for p, _ in unfused.get_submodule(name).named_parameters(recurse=False)]
        out |= {to_fused[k].rpartition(".")[0] for k in keys if k in to_fused} or {name}
    return out


# --- regional compile and torch.compile -------------------------------------------------------------------------

def compiled_regions(model) -> list[str]:
    """Which modules `compile_repeated_blocks` compiles (torch.compile is lazy: nothing is traced here)."""
    model.compile_repeated_blocks(backend="eager")
    return sorted(n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None)


@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_regional_compile_same_regions(family_name, config_name):
    _, _, stock, unfused = build(family_name, config_name)
    expected = on_stock("compile_repeated_blocks", compiled_regions, stock)
    assert compiled_regions(unfused) == expected


def test_regional_compile_runs_and_matches_stock():
    """One family through dynamo (the cheap `eager` backend): the compiled unfused blocks give stock's output."""
    name, config_name = next((n, c) for n, c in CASES if surgery.extend.families()[n].rewrites
                             and getattr(surgery.extend.families()[n].model_class, "_repeated_blocks", None))
    family, config, stock, unfused = build(name, config_name)
    torch._dynamo.reset()
    unfused.compile_repeated_blocks(backend="eager")
    assert_same_outputs(run(unfused, family, config, 1), run(stock, family, config, 1))


@pytest.mark.heavy  # dynamo traces every family (~2 s each); the default tier runs one: the test above
@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_torch_compile(family_name, config_name):
    family, config, stock, unfused = build(family_name, config_name)
    ref = run(stock, family, config, 1)
    torch._dynamo.reset()
    compiled = torch.compile(unfused, backend="eager")
    try:
        got = run(compiled, family, config, 1)
    except Exception:
        torch._dynamo.reset()
        on_stock("torch.compile", lambda m: run(torch.compile(m, backend="eager"), family, config, 1), stock)
        raise
    assert_same_outputs(got, ref)


# --- caches ------------------------------------------------------------------------------------------------------

def cache_config(kind: str, clock: list):
    from diffusers.hooks import (FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig,
                                 PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig)

    if kind == "first_block":
        return FirstBlockCacheConfig(threshold=0.5)
    if kind == "taylorseer":  # diffusers' own test config, factors in fp32 so that outputs compare tightly
        return TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=1, max_order=1,
                                     taylor_factors_dtype=torch.float32)
    if kind == "taylorseer_lite":
        return TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=1, max_order=1,
                                     taylor_factors_dtype=torch.float32, use_lite_mode=True)
    if kind == "faster":  # diffusers' own FLUX pipeline test config (tests/pipelines/flux: guidance-distilled)
        return FasterCacheConfig(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
                                 unconditional_batch_skip_range=2, attention_weight_callback=lambda _: 0.5,
                                 is_guidance_distilled=True, current_timestep_callback=lambda: clock[0])
    if kind == "pab":
        return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                               spatial_attention_timestep_skip_range=(100, 800),
                                               current_timestep_callback=lambda: clock[0])
    if kind == "mag":  # diffusers' own test config: neutral ratios, high threshold, so that later steps are skipped
        return MagCacheConfig(num_inference_steps=4, retention_ratio=0.0, threshold=100.0, mag_ratios=[1.0] * 4)
    if kind == "sea":
        from diffusers.hooks import SeaCacheConfig

        return SeaCacheConfig()
    raise ValueError(kind)


CACHES = ["first_block", "taylorseer", "taylorseer_lite", "faster", "pab", "mag", "sea"]


def cached_run(model, family, config, kind):
    clock = [1000]
    model.enable_cache(cache_config(kind, clock))
    hooks = hooked(model)
    outs = []
    with torch.no_grad():
        for i, kw in enumerate(steps(family, config, 4)):
            clock[0] = 1000 if i == 0 else 500
            with model.cache_context("cond"):
                outs.append(W.output(model, kw))
    model.disable_cache()
    return hooks, outs


@pytest.mark.parametrize("family_name,config_name,kind", in_turn(CACHES))
def test_cache(family_name, config_name, kind):
    family, config, stock, unfused = build(family_name, config_name)
    hooks, ref = on_stock(f"the {kind} cache", lambda m: cached_run(m, family, config, kind), stock)
    got_hooks, got = cached_run(unfused, family, config, kind)
    assert got_hooks == hooks, "the cache hooks other modules than on the stock model"
    assert_same_outputs(got, ref)
    assert hooked(unfused) == {}, "disable_cache left hooks behind"


# --- layer skip ----------------------------------------------------------------------------------------------------

SKIPS = {
    "block": dict(skip_attention=True, skip_ff=True),
    "attention": dict(skip_attention=True, skip_ff=False),
    "ff": dict(skip_attention=False, skip_ff=True),
    "attention_scores": dict(skip_attention=False, skip_attention_scores=True, skip_ff=False),
}


@pytest.mark.parametrize("family_name,config_name,skip", in_turn(list(SKIPS)))
def test_layer_skip(family_name, config_name, skip):
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    family, config, stock, unfused = build(family_name, config_name)
    stacks = [s for s in ("transformer_blocks", "single_transformer_blocks") if hasattr(stock, s)]

    def apply(model):
        for fqn in stacks:
            apply_layer_skip(model, LayerSkipConfig(indices=[0], fqn=fqn, **SKIPS[skip]))
        return hooked(model), run(model, family, config, 1)

    plain = run(stock, family, config, 1)
    hooks, ref = on_stock(f"layer skip ({skip})", apply, stock)
    if not hooks:  # stock diffusers finds no module to skip (its class lists miss this family's): nothing to compare
        pytest.skip(f"stock diffusers' layer skip ({skip}) hooks no module of {type(stock).__name__}")
    assert rel_err(ref[0], plain[0]) > 100 * TOL, "the skip changed nothing: the comparison would prove nothing"
    got_hooks, got = apply(unfused)
    assert got_hooks == hooks
    assert_same_outputs(got, ref)


# --- group offloading and layerwise casting ------------------------------------------------------------------------

@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_group_offload(family_name, config_name, offload_type):
    family, config, stock, unfused = build(family_name, config_name)
    cpu = torch.device("cpu")

    def apply(model):
        model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type=offload_type,
                                   num_blocks_per_group=1 if offload_type == "block_level" else None)
        return hooked(model), run(model, family, config, 2)

    hooks, ref = on_stock(f"group offloading ({offload_type})", apply, stock)
    got_hooks, got = apply(unfused)
    if offload_type == "block_level":
        assert got_hooks == hooks
    else:
        assert stock_names(unfused, got_hooks) == set(hooks)
    assert_same_outputs(got, ref)


@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_layerwise_casting(family_name, config_name):
    family, config, stock, unfused = build(family_name, config_name)

    def apply(model):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        elements = {}
        for p in model.parameters():
            elements[str(p.dtype)] = elements.get(str(p.dtype), 0) + p.numel()
        return elements, run(model, family, config, 1)

    elements, ref = on_stock("layerwise casting", apply, stock)
    got_elements, got = apply(unfused)
    assert got_elements == elements, "other parameters kept in float32 than on the stock model"
    assert_same_outputs(got, ref)


# --- device_map / _no_split_modules ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_device_map_groups(family_name, config_name):
    """accelerate's `infer_auto_device_map` over three small devices: the same module groups on each device."""
    from accelerate import infer_auto_device_map

    _, _, stock, unfused = build(family_name, config_name)
    if not stock._no_split_modules:  # diffusers' own class attribute: from_pretrained refuses device_map='auto' then
        pytest.skip(f"stock {type(stock).__name__} has no `_no_split_modules`: diffusers refuses device_map='auto'")

    def device_map(model):
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        budget = {0: size // 3, 1: size // 3, "cpu": 4 * size}
        return infer_auto_device_map(model, max_memory=budget, no_split_module_classes=model._no_split_modules)

    expected = on_stock("device_map", device_map, stock)
    assert device_map(unfused) == expected


# --- attention backends and processors ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["native", "_native_math"])
@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_attention_backend(family_name, config_name, backend):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    family, config, stock, unfused = build(family_name, config_name)
    active = _AttentionBackendRegistry.get_active_backend()[0]
    try:
        def apply(model):
            model.set_attention_backend(backend)
            return run(model, family, config, 1)

        ref = on_stock(f"attention backend {backend}", apply, stock)
        got = apply(unfused)
    finally:
        _AttentionBackendRegistry.set_active_backend(active)
    assert_same_outputs(got, ref)


@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_attn_processors_round_trip(family_name, config_name):
    family, config, stock, unfused = build(family_name, config_name)
    stock_procs = on_stock("attn_processors", lambda m: m.attn_processors, stock)
    procs = unfused.attn_processors
    assert len(procs) == len(stock_procs)
    assert sorted(procs) == sorted(stock_procs)
    # the same processors put back, then fresh processors of the stock model's classes (what a user would set)
    unfused.set_attn_processor(dict(procs))
    assert_same_outputs(run(unfused, family, config, 1), run(stock, family, config, 1))
    fresh = {name: type(p)() for name, p in stock_procs.items()}
    stock.set_attn_processor({name: type(p)() for name, p in stock_procs.items()})
    unfused.set_attn_processor(fresh)
    assert len(unfused.attn_processors) == len(stock_procs)
    assert_same_outputs(run(unfused, family, config, 1), run(stock, family, config, 1))


@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_fuse_qkv_projections(family_name, config_name):
    family, config, stock, unfused = build(family_name, config_name)

    def fuse(model):
        model.fuse_qkv_projections()
        return run(model, family, config, 1)

    ref = on_stock("fuse_qkv_projections", fuse, stock)
    assert_same_outputs(fuse(unfused), ref)
    stock.unfuse_qkv_projections()
    unfused.unfuse_qkv_projections()
    assert_same_outputs(run(unfused, family, config, 1), run(stock, family, config, 1))


# --- gradient checkpointing ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_gradient_checkpointing(family_name, config_name):
    family, config, stock, unfused = build(family_name, config_name)
    kw = W.inputs(family, config, 0)

    def checkpointed(model):
        model.enable_gradient_checkpointing()
        calls = []
        for name, module in model.named_modules():
            inner = getattr(module, "_gradient_checkpointing_func", None)
            if inner is not None:
                def counting(block, *args, _inner=inner, _name=name, **kwargs):
                    calls.append(_name)
                    return _inner(block, *args, **kwargs)

                module._gradient_checkpointing_func = counting
        return calls, W.gradients(model, kw, 0)

    calls, (ref_in, ref) = on_stock("gradient checkpointing", checkpointed, stock)
    got_calls, (got_in, got) = checkpointed(unfused)
    assert len(got_calls) == len(calls) > 0, "other blocks checkpointed than on the stock model"
    got = surgery.state_dict.fuse_state_dict(got, surgery.state_dict.weight_slices(unfused))
    assert sorted(got) == sorted(ref)
    for name, error in W.gradient_errors(got, ref).items():
        assert error <= W.FP32_GRAD_TOL, name
    for name, grad in ref_in.items():
        assert rel_err(got_in[name], grad) <= W.FP32_GRAD_TOL, name


# --- LoRA save: diffusers' errors and adapters that unfuse need not split -------------------------------------------

def test_save_lora_adapter_wrong_name_raises_diffusers_error(tmp_path):
    from peft import LoraConfig

    _, _, stock, unfused = build("flux2", next(iter(surgery.extend.families()["flux2"].tests.configs)))
    for model in (stock, unfused):
        model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["x_embedder"], init_lora_weights=False))
        with pytest.raises(ValueError, match="Adapter name foo not found in the model."):
            model.save_lora_adapter(tmp_path, adapter_name="foo")


@pytest.mark.parametrize("extra", [dict(lora_bias=True), dict(use_dora=True)])
def test_save_lora_adapter_with_bias_or_dora_on_modules_never_split(tmp_path, extra):
    """A LoRA bias or DoRA magnitude on a module `unfuse` leaves whole is saved as stock saves it."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    _, _, stock, unfused = build("flux2", next(iter(surgery.extend.families()["flux2"].tests.configs)))
    saved = {}
    for name, model in (("stock", stock), ("unfused", unfused)):
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["x_embedder", "context_embedder"],
                                     init_lora_weights=False, **extra))
        model.save_lora_adapter(tmp_path / name)
        saved[name] = load_file(tmp_path / name / "pytorch_lora_weights.safetensors")
    assert sorted(saved["unfused"]) == sorted(saved["stock"])
    assert any(".lora_B.bias" in k or "magnitude" in k for k in saved["stock"])
    for key, value in saved["stock"].items():
        assert torch.equal(saved["unfused"][key], value), key


# --- under tensor parallelism (diffusers runs its hooks on whatever the blocks return) ---------------------------------

TP_FEATURES = ["first_block", "taylorseer", "mag", "layer_skip"]


def _heavy(family_name: str, feature: str) -> bool:
    return feature != "regional_compile" and heavy_in_turn(family_name, TP_FEATURES, feature)


@functools.lru_cache(maxsize=None)
def tp_results(heavy: bool) -> list[dict]:
    """One gloo job at world 2: each family's unfused model sharded, with each feature of the tier, against the stock
    model with the same feature on one device; plus regional compile (eager backend) for one family."""
    # plans-only families too: their sharded model against the single-device one is a real comparison
    cases = [(n, c, [f for f in TP_FEATURES if _heavy(n, f) == heavy]) for n, c in CASES]
    if not heavy:
        compile_case = next(n for n, c, _ in cases
                            if surgery.extend.families()[n].rewrites
                            and getattr(surgery.extend.families()[n].model_class, "_repeated_blocks", None))
        cases = [(n, c, f + ["regional_compile"] if n == compile_case else f) for n, c, f in cases]
    return run_on_cpu_ranks(TPW.run, 2, cases)


@pytest.mark.parametrize("family_name,config_name,feature", in_turn(TP_FEATURES) + [
    pytest.param(n, c, "regional_compile", id=f"{n}-regional_compile") for n, c in CASES])
def test_feature_under_tensor_parallel(family_name, config_name, feature):
    results = tp_results(_heavy(family_name, feature))
    key = f"{family_name}/{feature}"
    if key not in results[0]:
        pytest.skip("regional compile under TP runs for one family only (dynamo is slow on 2 cores)")
    for rank, result in enumerate(results):
        if "stock_refuses" in result[key]:
            pytest.skip(f"stock refuses {feature}: {result[key]['stock_refuses']}")
        assert "error" not in result[key], f"rank {rank}: {result[key].get('error')}"
        assert max(result[key]["errors"]) <= TOL, f"rank {rank}: {result[key]['errors']}"


STOCK_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_out", "proj_mlp",
                 "to_qkv_mlp_proj", "linear_in"]


@pytest.mark.parametrize("family_name,config_name", CASES, ids=IDS)
def test_add_adapter_with_stock_target_modules(family_name, config_name, tmp_path):
    """`add_adapter(LoraConfig(target_modules=<stock names>))` adapts the stock layers: `save_lora_adapter` writes
    the stock model's keys and shapes (a new part named like a stock module is not picked; a fused module's name
    picks its parts)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    _, _, stock, unfused = build(family_name, config_name)
    saved = {}
    for name, model in (("stock", stock), ("unfused", unfused)):
        config = LoraConfig(r=2, lora_alpha=2, target_modules=list(STOCK_TARGETS), init_lora_weights=False)
        on_stock("add_adapter", lambda m: m.add_adapter(config), model) if name == "stock" else model.add_adapter(config)
        model.save_lora_adapter(tmp_path / name)
        # lora_B's rows and lora_A's columns (the adapted layer's sizes); the rank of a fused layer's adapter is
        # r x parts where the parts were trained separately (joined block-diagonally, exactly)
        saved[name] = {k: tuple(v.shape)[0 if "lora_B" in k else 1] for k, v in
                       load_file(tmp_path / name / "pytorch_lora_weights.safetensors").items()}
    assert saved["unfused"] == saved["stock"]
