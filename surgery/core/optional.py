"""Optional packages, imported where a verb needs one: `import surgery` and the base verbs work with the base install.

transformers, peft, torchao and gguf serve particular paths (a pipeline's text encoders, LoRA, quantized weights, GGUF
files); a user without that path has no reason to install them, so no module imports them at its top. A verb that
needs one calls `need` and, where it is missing, refuses in one line naming the package and why.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from surgery.core.errors import SurgeryError

# import name -> the distribution to install
_DISTRIBUTIONS = {"model_explorer": "ai-edge-model-explorer"}


def need(module: str, why: str) -> ModuleType:
    """`module` imported, or a SurgeryError saying that `why` needs its package and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.partition(".")[0]
        raise SurgeryError(f"{why} needs the optional package {top!r} ({error}): "
                           f"pip install {_DISTRIBUTIONS.get(top, top)}") from None
