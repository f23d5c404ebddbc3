"""Each family lives where a newcomer looks for it: in the `rewrites/` module named after the library module that
defines its model class, by the one rule of `rewrites/__init__.py`."""

from __future__ import annotations

import importlib
import pkgutil
import re
import unittest

import surgery  # noqa: F401  (registers the built-in families)
import surgery_rewrites
from surgery.core.registry import families

# the modules that hold no model family of their own: what several families share, the published pipelines
SHARED = {"diffusers_common", "pipelines"}


def module_file_name(family) -> str:
    """The file name (no `.py`) of the diffusers or transformers module that defines the family's model class."""
    cls = family.model_class
    qualified = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    module = qualified.rsplit(".", 1)[0]
    if not module.startswith(("diffusers.models.transformers.", "transformers.models.")):
        raise AssertionError(f"{family.name}: {qualified} is neither diffusers' transformer nor transformers' model")
    return module.rsplit(".", 1)[1]


def rewrites_name(module_file: str) -> str:
    """The rule: less a leading `transformer_` / `modeling_` and a trailing `_transformer` (`_2d`, `_3d`)."""
    return re.sub(r"^(transformer|modeling)_|_transformer(_[23]d)?$", "", module_file)


def families_by_file() -> dict[str, list]:
    found = {}
    for info in pkgutil.iter_modules(surgery_rewrites.__path__):
        module = importlib.import_module(f"surgery_rewrites.{info.name}")
        held = getattr(module, "FAMILIES", None)  # as rewrites/__init__.py reads it
        found[info.name] = [module.FAMILY] if held is None else list(held)
    return found


class Layout(unittest.TestCase):
    def test_the_rule(self):
        self.assertEqual(rewrites_name("transformer_wan"), "wan")
        self.assertEqual(rewrites_name("auraflow_transformer_2d"), "auraflow")
        self.assertEqual(rewrites_name("sana_transformer"), "sana")
        self.assertEqual(rewrites_name("modeling_qwen3_vl"), "qwen3_vl")
        self.assertEqual(rewrites_name("lumina_nextdit2d"), "lumina_nextdit2d")

    def test_each_family_lives_in_the_file_named_after_its_model_module(self):
        wrong = [f"{family.name} ({module_file_name(family)}.py) is in rewrites/{file}.py, not "
                 f"rewrites/{rewrites_name(module_file_name(family))}.py"
                 for file, held in families_by_file().items() if file not in SHARED
                 for family in held if rewrites_name(module_file_name(family)) != file]
        self.assertEqual(wrong, [])

    def test_every_registered_family_is_in_one_file(self):
        held = [family.name for found in families_by_file().values() for family in found]
        self.assertEqual(sorted(held), sorted(families()))

    def test_the_shared_files_hold_no_model(self):
        for file in SHARED:
            for family in families_by_file()[file]:
                self.assertIsNone(family.model_class, f"rewrites/{file}.py: {family.name}")


if __name__ == "__main__":
    unittest.main()
