"""The notebooks run top to bottom in a fresh kernel (their committed outputs come from such a run)."""

import pytest
import unittest
from pathlib import Path

import nbformat
import page_width as PW
from nbclient import NotebookClient
from parameterized import parameterized

pytestmark = pytest.mark.heavy  # the heavy tier: CI's second command (tests/conftest.py)

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


class Notebooks(unittest.TestCase):
    def test_there_are_notebooks(self):
        self.assertGreaterEqual(len(NOTEBOOKS), 2)

    @parameterized.expand([(path.name,) for path in NOTEBOOKS])
    def test_runs_clean(self, name):
        path = next(p for p in NOTEBOOKS if p.name == name)
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.output_type == "error"]
        self.assertEqual(errors, [])
        # quiet: no warning boxes (a library's warnings that the reader can do nothing about are filtered at the source)
        warnings = [o.text for cell in notebook.cells for o in cell.get("outputs", [])
                    if o.output_type == "stream" and o.name == "stderr" and "Warning" in o.text]
        self.assertEqual(warnings, [])
        # every picture of the fresh run fits a notebook cell
        for where, kind, data in PW.pictures(notebook):
            with self.subTest(where=where):
                self.assertIsNone(PW.too_wide(kind, data, PW.NOTEBOOK_WIDTH_PX))
