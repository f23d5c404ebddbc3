"""The built-in model families, one module each; installed as `surgery_rewrites` (a name no other package takes).

Each module exports `FAMILY`, a `surgery.extend.Family` (or a table of derived families, `FAMILIES`); importing this package
registers every one of them. `import surgery`
does that, after the engine: the engine never imports a family.
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
