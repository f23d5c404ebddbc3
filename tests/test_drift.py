"""Drift: every edit `surgery.core.leaves` makes to a diffusers method still finds its text in the installed diffusers.

No diffusers forward or processor is copied into this repository: the twins are the installed stock source with the
edits listed in `surgery.core.leaves.EDITS` (one place). When a diffusers release changes an original, its edit no longer
fits and this test names it, instead of a frozen copy silently diverging.
"""

import importlib
import inspect
import textwrap
import unittest

import surgery
from surgery.core import leaves
from surgery.core.errors import SurgeryError


def _owner(key: str):
    module, cls, method = key.rsplit(".", 2)
    return getattr(importlib.import_module(module), cls), method


class Drift(unittest.TestCase):
    def test_every_listed_edit_fits_the_installed_source_exactly(self):
        surgery.core.registry.registered()  # builds every family's twins
        for key, edits in leaves.EDITS.items():
            stock, method = _owner(key)
            source = textwrap.dedent(inspect.getsource(getattr(stock, method)))
            for old, new, count in edits:
                self.assertEqual(source.count(old), count, f"{key}: {old!r}")
            edited = leaves.edited_source(stock, method)
            # the twin differs from the stock source in the listed edits only
            undone = edited
            for old, new, _ in edits:
                undone = undone.replace(new, old)
            self.assertEqual(undone, source, key)
            self.assertNotEqual(edited, source, key)

    def test_every_twin_in_use_is_built_from_a_listed_edit(self):
        surgery.core.registry.registered()
        for stock, twin in leaves._twins.items():
            method = "__call__" if "__call__" in vars(twin) else "forward"
            self.assertIn(f"{leaves.qualified(stock)}.{method}", leaves.EDITS)
            self.assertTrue(issubclass(twin, stock))

    def test_a_changed_original_is_refused_by_name(self):
        key = next(iter(leaves.EDITS))
        stock, method = _owner(key)
        saved = leaves.EDITS[key]
        leaves.EDITS[key] = ((saved[0][0], saved[0][1], saved[0][2] + 1),)  # what a changed original looks like
        try:
            with self.assertRaisesRegex(SurgeryError, "installed diffusers changed it"):
                leaves.edited_source(stock, method)
        finally:
            leaves.EDITS[key] = saved
