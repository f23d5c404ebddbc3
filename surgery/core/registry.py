"""The registry: each model family's descriptor, its rewrites and its tensor-parallel plans.

Each module of the built-in families' package (`rewrites/`, installed as `surgery_rewrites`) exports `FAMILY`, a
`Family`, and registers it when `import surgery` loads that package. Other packages add
their own with `register_family` (`surgery.extend`). Everything that serves
more than one family — the CLI, the demo, the planner, inspection, the benchmarks, the notebooks and the conformance
suite — looks a family up here, by name or by the model's class; the engine itself never imports a family's module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from surgery.core.errors import SurgeryError
from surgery.core.slicing import Slice


def _always(module: nn.Module) -> bool:
    return True


def _no_check(module: nn.Module, path: str, verb: str) -> None:
    return None


@dataclass(frozen=True)
class Rewrite:
    """One fused module class and its equivalent unfused form.

    `slices(module)` lists, for either form, which rows/columns of each fused parameter each unfused parameter is.
    `build_unfused` / `build_fused` return the other form's structure on the meta device, sharing every submodule that
    is not a slice target; the engine fills the slice targets. Neither builder may mutate its argument.
    """

    name: str
    fused: type[nn.Module]
    unfused: type[nn.Module]
    slices: Callable[[nn.Module], list[Slice]]
    build_unfused: Callable[[nn.Module], nn.Module]
    build_fused: Callable[[nn.Module], nn.Module]
    is_fused: Callable[[nn.Module], bool] = field(default=_always)
    # Where both forms are one class (a stock class whose leaves or processors are swapped), what tells the unfused
    # form apart; the two predicates must never both accept a module.
    is_unfused: Callable[[nn.Module], bool] = field(default=_always)
    # Family-specific checks run before anything changes, on either form: `check(module, path, verb)`.
    check: Callable[[nn.Module, str, str], None] = field(default=_no_check)
    # False where diffusers checkpoints never hold the fused keys (a run-time fusion like `fuse_qkv_projections`).
    in_checkpoints: bool = True

    def matches_fused(self, module: nn.Module) -> bool:
        return type(module) is self.fused and self.is_fused(module)

    def matches_unfused(self, module: nn.Module) -> bool:
        return type(module) is self.unfused and self.is_unfused(module)


@dataclass(frozen=True)
class TensorParallel:
    """How `surgery.tensor_parallel` shards a family's modules. Each table is keyed by module class (or its qualified
    name, "package.module.Class", so that a family's plans cost no import of the library that defines it)."""

    # class -> {submodule path relative to the module ("" is the module itself): a stock ParallelStyle}
    plans: dict = field(default_factory=dict)
    # class -> `check(module, path, world_size)`: raises SurgeryError for sizes the mesh cannot split
    checks: dict = field(default_factory=dict)
    # class -> `when(module)`: the class's plan applies only to the modules it accepts; the others stay whole
    # (replicated). For diffusers' shared classes (`Attention`) whose modules only some families can shard.
    when: dict = field(default_factory=dict)
    # class -> {Linear path relative to the class's module (fnmatch pattern): why it stays whole on every rank}:
    # Linears inside transformer blocks that no plan shards on purpose (`surgery.tensor_parallel` refuses the others)
    replicated: dict = field(default_factory=dict)
    # attention class -> names of its forward's keyword arguments that carry rotary tables its processor applies
    # across the whole attention width, before splitting heads (LTX-Video, LTX-2): each rank gets its heads' share
    rotary: dict = field(default_factory=dict)
    # `all_reduces(config)`: the all-reduces one forward of the model built from `config` makes when sharded
    all_reduces: Callable[[dict], int] | None = None


@dataclass(frozen=True)
class Tests:
    """What the conformance suite (tests/families/test_conformance.py) runs a family on."""

    __test__ = False  # a descriptor, not a pytest class

    # small configs (the published structure, tiny widths) the suite builds on CPU
    configs: dict[str, dict] = field(default_factory=dict)
    # a lower precision the stock forward rounds to even in float32 (Kandinsky 5's rotary casts q/k to bfloat16, and
    # so their gradients): sharded and whole gradients then agree to that precision only, not float32's
    rounds_to: torch.dtype | None = None
    # the diffusers attention backend (`AttentionBackendName` value, e.g. "native") the gradient checks compute the
    # model's `flex` attention with, where its stock processor dispatches to `flex`, which has no backward on CPU
    # (torch 2.13): its `BlockMask` made dense (`surgery.testing.flex_as`). The forward is checked with both kernels.
    flex_backward: str | None = None


@dataclass(frozen=True, repr=False)
class Family:
    """Everything the tools need to know about one model family, declared in its `rewrites/<module>.py`: the model,
    how it shards (`tp`) and what the conformance suite runs it on (`tests`).

    `model_class` is the diffusers (or transformers) class, or its qualified name where importing it would cost a
    library. `variants` maps a published checkpoint's short name to its config (init arguments of `model_class`);
    `sources` says where those numbers come from. `example_inputs(config, batch=, image_tokens=, text_tokens=, seed=,
    dtype=, device=)` returns seeded keyword arguments for `model_class.forward`. `shrink_config(config)` shrinks a
    published config to demo size (depth and head size, same head count).
    """

    name: str
    model_class: type[nn.Module] | str | None  # None: a file of plans for modules that several families share
    variants: dict[str, dict] = field(default_factory=dict)
    sources: str = ""
    default_variant: str | None = None
    example_inputs: Callable[..., dict] | None = None
    shrink_config: Callable[[dict], dict] | None = None
    # `--model` name, or a diffusers transformer class name (all its variants) -> {"pipeline": class name, component
    # name: (class, config class or None, config)}: what the published pipeline holds besides its transformer
    # (`surgery plan --pipeline` builds each on meta)
    pipelines: dict[str, dict] = field(default_factory=dict)
    # the attention processor (a class, called with no arguments) the published pipeline sets on every attention of
    # the model where that is not the model's own default (DreamLite's UNet sets its grouped-query one on the
    # DreamLiteTransformer2DModels it holds; their default cannot run one key/value head): `build` sets it
    processor: Callable[[], object] | None = None
    rewrites: tuple[Rewrite, ...] = ()
    tp: TensorParallel = field(default_factory=TensorParallel)
    tests: Tests = field(default_factory=Tests)

    def __repr__(self) -> str:
        return f"Family({self.name!r}, variants={sorted(self.variants)})"

    def config(self, variant: str | None = None) -> dict:
        variant = variant or self.default_variant
        if variant not in self.variants:
            raise SurgeryError(f"model family {self.name!r} has no variant {variant!r}; known: {sorted(self.variants)}.")
        return dict(self.variants[variant])

    def model_name(self, variant: str | None = None) -> str:
        """The `--model` name of a variant: `<family>-<variant>`, or the family's name alone where they are equal."""
        variant = variant or self.default_variant
        # A variant named like the family (`qwen-image`) or like its last word (`bria-fibo`'s `fibo`) is the family's
        # name alone, not `bria-fibo-fibo`.
        if variant == self.name or self.name.endswith(f"-{variant}"):
            return self.name
        return f"{self.name}-{variant}"

    def model_names(self) -> list[str]:
        """The `--model` names of this family's variants."""
        return [self.model_name(v) for v in self.variants]


_registry: list[Rewrite] = []
_tp_plans: dict[type[nn.Module] | str, dict] = {}
_tp_checks: dict[type[nn.Module] | str, Callable[[nn.Module, str, int], None]] = {}
_tp_when: dict[type[nn.Module] | str, Callable[[nn.Module], bool]] = {}
_families: dict[str, Family] = {}
_replicated: dict[type[nn.Module] | str, dict[str, str]] = {}
_refused: dict[type[nn.Module], str] = {}
_rotary: dict[type[nn.Module], tuple[str, ...]] = {}


def register(*rewrites: Rewrite) -> None:
    """Add rewrites for a model family that lives outside the `rewrites` package."""
    for rewrite in rewrites:
        if any(r is rewrite for r in _registry):  # one rewrite shared by families of one attention class
            continue
        if any(r.name == rewrite.name for r in _registry):
            raise ValueError(f"A rewrite named {rewrite.name!r} is already registered.")
        _registry.append(rewrite)


def register_tp_plan(
    cls: type[nn.Module] | str,
    plan: dict,
    check: Callable[[nn.Module, str, int], None] | None = None,
    when: Callable[[nn.Module], bool] | None = None,
) -> None:
    """Declare how `surgery.tensor_parallel` shards modules of exactly class `cls`.

    `cls` may be a class or its qualified name ("package.module.Class"), so that a family's plans cost no import of
    the library that defines it. `plan` maps submodule paths relative to the module to stock `ParallelStyle`s; the
    key `""` is the module itself. `check(module, path, world_size)` raises `SurgeryError` for sizes the mesh cannot
    split (beyond the generic checks). `when(module)`, if given, limits the plan to the modules it accepts (the
    others of the class stay whole on every rank). A class has one plan: a module class shared by several families (diffusers'
    `FeedForward`) is planned once, in `rewrites/diffusers_common.py`.
    """
    if _tp_plans.get(cls, plan) is not plan:
        raise ValueError(f"{cls!r} already has a tensor-parallel plan; a module class is planned in one place only.")
    _tp_plans[cls] = plan
    if check is not None:
        _tp_checks[cls] = check
    if when is not None:
        _tp_when[cls] = when


def register_replicated(cls: type[nn.Module] | str, linears: dict[str, str]) -> None:
    """Declare Linears of modules of exactly class `cls` whole on every rank on purpose: `{path relative to the
    module (fnmatch pattern): the reason}`. `surgery.tensor_parallel` refuses a model whose transformer blocks hold a
    Linear that neither a plan nor such a declaration covers. A reason says why the Linear's input and output are
    whole on every rank (the conditioning embedding in, a modulation of the full-width hidden states out)."""
    for pattern, reason in linears.items():
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"{cls!r}: replicated Linear {pattern!r} needs its reason, a sentence.")
    _replicated.setdefault(cls, {}).update(linears)


def register_refused(cls: type[nn.Module], reason: str) -> None:
    """Refuse to shard models of exactly class `cls`, with `reason` (one line: what the model does that the plans
    cannot follow), where the derivation would otherwise plan it."""
    _refused[cls] = reason


def register_rotary(cls: type[nn.Module], names: tuple[str, ...]) -> None:
    """Declare that attention modules of exactly class `cls` take rotary tables in the keyword arguments `names`
    (each a `(cos, sin)` tuple or None) that their processor applies across the whole attention width, before
    splitting heads: the derived plan hands each rank its heads' share of them (`surgery.parallel.derive`)."""
    if isinstance(names, str) or not names:
        raise ValueError(f"{cls!r}: rotary takes a tuple of keyword-argument names, got {names!r}.")
    _rotary[cls] = tuple(names)


def rotary_inputs_for(module: nn.Module) -> tuple[str, ...]:
    """The keyword arguments of `module` (by its exact class) that carry rotary tables across its whole width."""
    return _rotary.get(type(module), ())


def refused_reason(model: nn.Module) -> str | None:
    return _refused.get(type(model))


def replicated_for(module: nn.Module) -> dict[str, str]:
    """The Linears declared whole on every rank for `module`'s exact class (by class or qualified name)."""
    cls = type(module)
    return {**_replicated.get(qualified_name(cls), {}), **_replicated.get(cls, {})}


def register_family(family: Family) -> None:
    """Register a model family: its descriptor, its rewrites and its tensor-parallel plans."""
    if family.name in _families:
        raise ValueError(f"A model family named {family.name!r} is already registered.")
    _families[family.name] = family
    register(*family.rewrites)
    for cls, plan in family.tp.plans.items():
        register_tp_plan(cls, plan, family.tp.checks.get(cls), family.tp.when.get(cls))
    for cls, linears in family.tp.replicated.items():
        register_replicated(cls, linears)
    for cls, names in family.tp.rotary.items():
        register_rotary(cls, names)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"



def registered() -> tuple[Rewrite, ...]:
    """Every registered rewrite."""
    return tuple(_registry)


def tp_plan_for(module: nn.Module) -> tuple[dict | None, Callable | None]:
    """The registered plan and check for `module`'s exact class (by class or by qualified name); none where the
    plan's `when` declines the module."""
    cls = type(module)
    key = cls if cls in _tp_plans else qualified_name(cls)
    when = _tp_when.get(key)
    if when is not None and not when(module):
        return None, None
    return _tp_plans.get(key), _tp_checks.get(key)


def tp_plans() -> dict[type[nn.Module] | str, dict]:
    """Every registered tensor-parallel plan, by module class (or qualified class name)."""
    return dict(_tp_plans)


def families() -> dict[str, Family]:
    """Every registered model family, by name."""
    return dict(_families)


def model_class(family: Family) -> type[nn.Module]:
    """The family's model class, imported if it was given by qualified name."""
    cls = family.model_class
    if isinstance(cls, str):
        module, _, name = cls.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    return cls


def family_of(model: nn.Module | type) -> Family:
    """The family whose model class `model` is (an instance or a class)."""
    cls = model if isinstance(model, type) else type(model)
    for family in families().values():
        if family.model_class in (cls, qualified_name(cls)):
            return family
    raise SurgeryError(
        f"no registered model family describes {cls.__name__}; known: "
        f"{', '.join(sorted(f.name for f in families().values() if f.variants))}. Register one with "
        "surgery.extend.register_family."
    )


def model_names(by_family: bool = False) -> list[str] | dict[str, list[str]]:
    """Every name `--model` accepts: each family alone (its default variant) and `<family>-<variant>`; with
    `by_family`, the same names grouped by family."""
    grouped = {}
    for family in families().values():
        if family.variants:
            grouped[family.name] = list(dict.fromkeys([family.name, *family.model_names()]))
    return grouped if by_family else [n for names in grouped.values() for n in names]


def resolve_model(name: str) -> tuple[Family, str]:
    """`(family, variant)` for a `--model` name: `flux2-klein-9b`, `flux1-dev`, `chroma` (a family's default)."""
    for family in families().values():
        if not family.variants:
            continue
        if name == family.name:
            return family, family.default_variant or next(iter(family.variants))
        if name.startswith(family.name + "-") and name[len(family.name) + 1 :] in family.variants:
            return family, name[len(family.name) + 1 :]
    raise SurgeryError(f"unknown model {name!r}; known: {', '.join(sorted(model_names()))}.")
