"""surgery: rewrite fused diffusion-transformer modules into equivalent unfused ones, then shard them with stock TP.

    import surgery
    surgery.unfuse(model)                 # in place; returns model
    surgery.tensor_parallel(model, mesh)  # stock parallelize_module; returns model
    surgery.fuse(model)                   # the exact inverse of unfuse

The public API is this module's `__all__` (the verbs) and three modules: `surgery.lora` (adapters),
`surgery.state_dict` (state dicts and checkpoints between layouts) and `surgery.extend` (what a model family imports).

The engine's layers, each importing only those before it (`tests/core/test_layers.py` checks every import):
`surgery.core` (the rewrite), `surgery.parallel` (TP, CP, pipelines), `surgery.io` (checkpoints),
`surgery.integration` (diffusers' features, LoRA), `surgery.extend`, the built-in families (`surgery_rewrites`), this
module, `surgery.testing`, `surgery.sight` (tables, diagrams) and `surgery.app` (the CLI).
"""

import functools
import logging


# diffusers' model base imports torchao where it is installed; on a machine without torchao's CUDA kernels torchao,
# torch's pytree and diffusers then log import-time warnings that no user can act on (and that would turn a CLI error's
# one line into ten). Import it first with those three loggers raised to errors, then put them back.
_QUIET = [logging.getLogger(name) for name in
          ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")]
_LEVELS = [logger.level for logger in _QUIET]
for _logger in _QUIET:
    _logger.setLevel(logging.ERROR)
import diffusers.models.modeling_utils  # noqa: E402,F401
for _logger, _level in zip(_QUIET, _LEVELS):
    _logger.setLevel(_level)

import torch.nn as nn  # noqa: E402

from surgery.core import rewrite as _rewrite
from surgery.core.errors import SurgeryError
from surgery.integration.interop import keep_diffusers_in_step
from surgery.io import loading as _loading
from surgery.io.saving import save_pretrained
from surgery.parallel import pipeline as _pipeline
from surgery.parallel.context_parallel import context_parallel
from surgery.parallel.decode import decode_parallel
from surgery.parallel.tensor_parallel import tensor_parallel
from surgery import extend, lora, state_dict  # noqa: F401  (the public modules)
import surgery_rewrites  # noqa: F401,E402  (registers the built-in families; the engine never imports them)

__all__ = [
    "unfuse",
    "fuse",
    "tensor_parallel",
    "load_tensor_parallel",
    "save_pretrained",
    "context_parallel",
    "tensor_parallel_pipeline",
    "decode_parallel",
    "SurgeryError",
]


def _in_step(verb):
    """`verb`, then diffusers' bookkeeping (`_tp_plan`, block-name lists, checkpoint hooks) fitted to the new modules."""

    @functools.wraps(verb)
    def public(*args, **kwargs):
        result = verb(*args, **kwargs)
        keep_diffusers_in_step(result)
        return result

    return public


unfuse = _in_step(_rewrite.unfuse)
fuse = _in_step(_rewrite.fuse)
load_tensor_parallel = _in_step(_loading.load_tensor_parallel)


@functools.wraps(_pipeline.tensor_parallel_pipeline)
def tensor_parallel_pipeline(pipe, *args, **kwargs):
    report = _pipeline.tensor_parallel_pipeline(pipe, *args, **kwargs)
    for component in getattr(pipe, "components", {}).values():
        if isinstance(component, nn.Module):
            keep_diffusers_in_step(component)
    return report
