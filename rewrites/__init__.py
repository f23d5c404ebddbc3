"""The built-in model families, one module each; installed as `surgery_rewrites` (a name no other package takes).

A family lives in the module named after the library module that defines its model class, by one rule: that
module's file name less a leading `transformer_` or `modeling_` and a trailing `_transformer`, `_transformer_2d` or
`_transformer_3d` (diffusers' `transformer_wan.py` -> `wan.py`, `auraflow_transformer_2d.py` -> `auraflow.py`,
`hunyuan_transformer_2d.py` (HunyuanDiT) -> `hunyuan.py`; transformers' `modeling_t5.py` -> `t5.py`);
`tests/families/test_layout.py` holds every registered family to it. What several families share lives in
`diffusers_common.py`; a family module imports another only where diffusers' own module imports that one (chroma
from flux, hunyuan_video_framepack from hunyuan_video; umt5 from t5, whose code transformers' UMT5 copies).
`pipelines.py` holds the published pipelines' components.

Each module exports `FAMILY`, a `surgery.extend.Family` (or a table of several, `FAMILIES`); importing this package
registers every one of them. `import surgery` does that, after the engine: the engine never imports a family.
"""

import importlib
import pkgutil

from surgery.extend import register_family

if __name__ != "surgery_rewrites":
    raise ImportError(f"the built-in families are the package `surgery_rewrites`, not {__name__!r} (importing both "
                      "would register every family twice); `import surgery` loads them.")

for _info in pkgutil.iter_modules(__path__):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    _families = getattr(_module, "FAMILIES", None)  # a data table holds several; an optional package's, maybe none
    for _family in (_module.FAMILY,) if _families is None else _families:
        register_family(_family)
