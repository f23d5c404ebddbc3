"""surgery: rewrite fused diffusion-transformer modules into equivalent unfused ones, then shard them with stock TP.

    import surgery
    surgery.unfuse(model)                 # in place; returns model
    surgery.tensor_parallel(model, mesh)  # stock parallelize_module; returns model
    surgery.fuse(model)                   # the exact inverse of unfuse

The engine's layers, each importing only those before it (`tests/test_layers.py` checks every import, those inside
functions too): `surgery.core` (the rewrite), `surgery.parallel` (TP, CP, pipelines), `surgery.io` (checkpoints),
`surgery.integration` (diffusers' features, LoRA), then the built-in families (`surgery_rewrites`), this module (the
public API), `surgery.testing`, `surgery.sight` (tables, diagrams) and `surgery.app` (the CLI).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from surgery.core.errors import SurgeryError
from surgery.core.registry import (
    Family,
    Rewrite,
    families,
    register,
    register_family,
    register_tp_plan,
    registered,
    tp_plans,
)
from surgery.core.rewrite import fuse, last_report, unfuse
from surgery.core.slicing import Slice
from surgery.core.state_dict import fuse_state_dict, key_map, unfuse_state_dict, weight_slices
from surgery.parallel.context_parallel import context_parallel
from surgery.parallel.pipeline import tensor_parallel_pipeline
from surgery.parallel.tensor_parallel import tensor_parallel
from surgery.io.checkpoint import convert_checkpoint
from surgery.io.loading import load_tensor_parallel
from surgery.io.saving import save_pretrained
from surgery import integration  # noqa: F401  (subscribes diffusers' integration to `unfuse` / `fuse`)
from surgery.integration.lora import (
    fuse_lora_state_dict,
    lora_target_modules,
    stock_lora_adapter,
    unfuse_lora_state_dict,
)
from surgery.integration.lora_tp import shard_lora
import surgery_rewrites  # noqa: F401,E402  (registers the built-in families; the engine above never imports them)

__all__ = [
    # user verbs
    "unfuse",
    "fuse",
    "tensor_parallel",
    "tensor_parallel_pipeline",
    "context_parallel",
    "load_tensor_parallel",
    "convert_checkpoint",
    "last_report",
    "weight_slices",
    "key_map",  # deprecated name of weight_slices
    "unfuse_state_dict",
    "fuse_state_dict",
    "save_pretrained",
    "unfuse_lora_state_dict",
    "fuse_lora_state_dict",
    "lora_target_modules",
    "stock_lora_adapter",
    "shard_lora",
    "SurgeryError",
    # extension API
    "Family",
    "Rewrite",
    "Slice",
    "families",
    "register",
    "register_family",
    "register_tp_plan",
    "registered",
    "tp_plans",
]


# Layers above the API load on first use (`surgery.sight.report`, `surgery.app.cli`): they need more than the verbs
# do, and importing them here would make them part of every `import surgery`.
_LAYERS_ABOVE = ("testing", "sight", "app")

# Module paths of the flat layout before the layers, kept as deprecated aliases: `surgery.inspect.rewrite_table(...)`
# still works, with a DeprecationWarning naming the new path.
_MOVED = {
    "inspect": "surgery.sight.report", "render": "surgery.sight.render", "diagram": "surgery.sight.diagram",
    "explore": "surgery.sight.explore", "leaves": "surgery.core.leaves", "registry": "surgery.core.registry",
    "checks": "surgery.core.checks", "slicing": "surgery.core.slicing", "walk": "surgery.core.walk",
    "split_projection": "surgery.core.split_projection", "rewrite": "surgery.core.rewrite",
    "state_dict": "surgery.core.state_dict", "agreement": "surgery.parallel.agreement",
    "distributed": "surgery.parallel.distributed", "transformers_plans": "surgery.parallel.transformers_plans",
    "pipeline": "surgery.parallel.pipeline", "atomic": "surgery.io.atomic", "checkpoint": "surgery.io.checkpoint",
    "saving": "surgery.io.saving", "loading": "surgery.io.loading", "lora": "surgery.integration.lora",
    "lora_tp": "surgery.integration.lora_tp", "diffusers_hooks": "surgery.integration.diffusers_hooks",
    "interop": "surgery.integration.interop", "cli": "surgery.app.cli", "demo": "surgery.app.demo",
    "verify": "surgery.testing",
}


def __getattr__(name: str):
    if name in _LAYERS_ABOVE:
        return importlib.import_module(f"surgery.{name}")
    if name in _MOVED:
        warnings.warn(f"surgery.{name} moved to {_MOVED[name]}; import it from there.", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'surgery' has no attribute {name!r}")


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import surgery.inspect` / `from surgery.registry import ...` (the flat paths): the module at its new path,
    with a DeprecationWarning. Consulted last, only for names no file answers."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "surgery" or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        name = spec.name.partition(".")[2]
        warnings.warn(f"{spec.name} moved to {_MOVED[name]}; import it from there.", DeprecationWarning, stacklevel=2)
        return importlib.import_module(_MOVED[name])

    def exec_module(self, module) -> None:
        pass  # the module at its new path is loaded already


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
