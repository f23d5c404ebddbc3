"""Building a registered family's model from a config: on meta for plans, or with seeded weights for tests."""

from __future__ import annotations

import inspect as pyinspect
import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

from surgery.core.errors import SurgeryError
from surgery.core.registry import Family, families, model_class, qualified_name, resolve_model


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules directly in `dtype` (no `.to()` pass over the parameters afterwards)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_config(model: str | dict, family: Family | None = None) -> tuple[Family, dict]:
    """`(family, config)` for a `--model` name, or for a config dict of `family`'s model class."""
    if isinstance(model, str):
        family, variant = resolve_model(model)
        return family, family.config(variant)
    if family is None:
        raise SurgeryError("pass family= with a config dict (surgery.extend.families() lists them; `surgery families` prints them), or a model name.")
    return family, dict(model)


def build(family: Family, config: dict) -> nn.Module:
    """`family`'s model from `config` (on the default device, in the default dtype) as its published pipeline runs
    it (`published_processor`)."""
    return published_processor(model_class(family)(**config), family)


def published_processor(model: nn.Module, family: Family | None = None) -> nn.Module:
    """`model` (of `family`, else of the family registered for its class) with each of its attentions given the
    processor the published pipeline sets (`Family.processor`), where the family names one; otherwise as it was."""
    if family is None:
        family = next((f for f in families().values() if f.model_class in (type(model), qualified_name(type(model)))),
                      None)
    if family is not None and family.processor is not None:
        for module in model.modules():
            if hasattr(module, "set_processor"):  # diffusers' attentions: `Attention`, `AttentionModuleMixin`
                module.set_processor(family.processor())
    return model


def model_on_meta(family: Family, config: dict, dtype: torch.dtype | None = None) -> nn.Module:
    """`family`'s model built from `config` on the meta device (nothing allocated), in `dtype` if given.

    A config the model class cannot be built from raises `SurgeryError` naming the family and the argument.
    """
    cls = model_class(family)
    check_config(family, config)
    try:
        with torch.device("meta"), default_dtype(dtype or torch.get_default_dtype()):
            model = build(family, config)
    except (TypeError, ValueError, ZeroDivisionError, RuntimeError) as error:
        raise SurgeryError(f"{family.name}: {cls.__name__} cannot be built from this config: {error}") from None
    # bytes per rank and the meta forward's dtypes are the published model's
    return keep_in_fp32(model)


def keep_in_fp32(model: nn.Module) -> nn.Module:
    """As `from_pretrained(torch_dtype=...)` loads a model in half precision: the modules diffusers keeps in float32
    (`_keep_in_fp32_modules`: FLUX.3's QK-norms, Kandinsky 5's time embeddings and modulations) back in float32."""
    keep = getattr(type(model), "_keep_in_fp32_modules", None) or ()
    if keep and model.dtype in (torch.float16, torch.bfloat16):
        for name, module in model.named_modules():
            if any(k in name.split(".") for k in keep):
                module.float()
    return model


MOST_LAYERS = 1024
MOST_WIDTH = 2**20


def check_config(family: Family, config: dict) -> None:
    """Unknown arguments and non-positive sizes in a config, named before the model class sees them."""
    cls = model_class(family)
    parameters = pyinspect.signature(cls.__init__).parameters
    unknown = sorted(k for k in config if k not in parameters)
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise SurgeryError(
            f"{family.name}: {cls.__name__} takes no argument {unknown[0]!r}"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}: is this config of another model?"
        )
    for key, value in config.items():
        if not isinstance(value, int) or isinstance(value, bool) or not (
                key.startswith("num_") or key.endswith(("_dim", "_heads", "channels"))):
            continue
        if value < 1:
            raise SurgeryError(f"{family.name}: config {key}={value}; it must be at least 1.")
        # beyond any published model by far (60 layers, widths of 1e5), and a building loop that would not end
        most = MOST_LAYERS if key.endswith(("layers", "blocks")) else MOST_WIDTH
        if value > most:
            raise SurgeryError(f"{family.name}: config {key}={value}; the most a model is built with here is {most}.")


def seeded_model(family: Family, config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """`family`'s model built from `config`, every weight (norm scales and biases too) drawn from `seed`, in eval mode.

    Matrices are N(0, 1/fan_in) (N(0, 1) where the module scales its weight itself, `self_scaled`), vectors
    N(1, 0.1): no parameter is left at an initializer's zeros or ones, so a rewrite that dropped or swapped one shows
    in the outputs.
    """
    torch.manual_seed(seed)
    with default_dtype(dtype):
        model = build(family, config)
    with torch.no_grad():
        # `from_pretrained(torch_dtype=...)` loads every floating entry of the state dict in that dtype, persistent
        # buffers too: those a constructor makes float32 whatever the default dtype (OmniGen's and SD3's `pos_embed`)
        # would otherwise promote the hidden states they are added to
        persistent = model.state_dict(keep_vars=True)
        for name, buffer in list(model.named_buffers()):
            if name in persistent and buffer.is_floating_point() and buffer.dtype != dtype:
                module, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module), leaf, buffer.to(dtype))
        scaled = {id(m.weight) for m in model.modules() if self_scaled(m)}
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 1.0 if id(param) in scaled else param.shape[-1] ** -0.5)
            else:
                param.normal_(1.0, 0.1)
    return keep_in_fp32(model).eval()


def self_scaled(module: nn.Module) -> bool:
    """Whether `module` multiplies its `weight` by 1/sqrt(fan in) itself in its forward, its `scale` (StyleGAN's
    equalized learning rate: WanAnimate's motion encoder, `MotionConv2d` and `MotionLinear`, whose constructors draw
    the weight N(0, 1)). Seeded N(0, 1) as well: N(0, 1/fan_in) there scales the weight twice, each 512-wide
    `MotionLinear` passing its input on 512**0.5-fold smaller: the motion features were their seeded biases whatever
    the face video (at the published width another random face moved the motion vector by 1e-07 of it; 2e-03 seeded
    N(0, 1))."""
    weight, scale = getattr(module, "weight", None), getattr(module, "scale", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() > 1 and isinstance(scale, float)
            and math.isclose(scale, weight[0].numel() ** -0.5))


def tuple_output(model: nn.Module) -> dict:
    """The keyword that makes `model`'s forward return a tuple: `return_dict=False` for diffusers' models; nothing for a
    forward that takes no such argument (it returns its tensor as it is)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper forwards any keyword to the model's own
    parameters = pyinspect.signature(model.forward).parameters.values()
    takes = any(p.name == "return_dict" or p.kind is p.VAR_KEYWORD for p in parameters)
    return {"return_dict": False} if takes else {}


def sample(model: nn.Module, **inputs) -> torch.Tensor:
    """`model`'s output tensor for `inputs`, however its forward returns it: the first entry of diffusers' tuple, the
    tensor itself, or one tensor per sample (stacked)."""
    out = model(**inputs, **tuple_output(model))
    out = out[0] if isinstance(out, tuple) else out
    return torch.stack(out) if isinstance(out, (list, tuple)) else out
