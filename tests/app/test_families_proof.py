"""What the project says it supports is the registry plus the last proof, never written by hand.

The proof (`surgery/app/families.json`) is written from a real run by `python tests/families/test_conformance.py
--regenerate`: the plan step for every diffusers transformer class, and each registered family's gloo run at world 2
and 4. A class is sharded there only where a registered family runs in the conformance suite (a family with variants
and no test configs fails that suite); docs/families.md, the README's table and `surgery families` are rendered from
it, and these tests fail when any of them, or the proof itself, disagrees with the registry.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import unittest
from unittest import mock

import diffusers
import pytest

import conformance_worker as W
import surgery  # noqa: F401  (registers the built-in families)
import surgery_cli
from surgery.app import cli, coverage
from surgery.core.registry import families, model_class


class Proof(unittest.TestCase):
    def setUp(self):
        self.proof = surgery_cli.read_proof()
        self.registered = {model_class(f).__name__: f for f in families().values() if f.variants}

    def test_lists_every_installed_transformer_class_once(self):
        self.assertEqual(self.proof["diffusers"], diffusers.__version__)
        self.assertEqual([r["class"] for r in self.proof["classes"]],
                         [cls.__name__ for cls in coverage.transformer_classes()])

    def test_sharded_exactly_where_a_registered_family_runs_in_the_conformance_suite(self):
        for row in self.proof["classes"]:
            family = self.registered.get(row["class"])
            self.assertEqual(row["family"], family.name if family else "", row["class"])
            if family is None:
                self.assertNotEqual(row["status"], "sharded", f"{row['class']}: sharded, but no family registers it")
                self.assertNotIn("errors", row)
                self.assertTrue(row["reason"] or row["status"] == "planned, unproven", row["class"])
                continue
            self.assertEqual(row["status"], "sharded", f"{family.name} is registered: {row['reason']}")
            self.assertIn((family.name, next(iter(family.tests.configs), None)), W.family_cases(tp_only=True))
            self.assertEqual(sorted(row["errors"]), ["2", "4"], family.name)
            for world, errors in row["errors"].items():
                self.assertLessEqual(errors["forward"], W.FP32_TOL, (family.name, world))
                self.assertLessEqual(errors["gradients"], W.grad_tolerance(family), (family.name, world))

    def test_every_registered_family_is_in_the_proof(self):
        self.assertLessEqual(set(self.registered), {r["class"] for r in self.proof["classes"]})

    def test_docs_families_page_is_the_proof(self):
        self.assertEqual(coverage.DOC.read_text(), coverage.document(self.proof),
                         "run `python tests/families/proof.py`")

    def test_readme_table_is_the_registry_and_the_proof(self):
        self.assertEqual(coverage.readme_section(coverage.README.read_text()), coverage.readme_table(),
                         "run `python tests/families/proof.py`")


class SurgeryFamilies(unittest.TestCase):
    def test_prints_the_proof_without_importing_torch_diffusers_or_the_package(self):
        code = ("import sys, surgery_cli; surgery_cli.main(['families']); "
                "print(sorted(m for m in ('torch', 'diffusers', 'surgery') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        self.assertEqual(out, surgery_cli.listing() + "\n[]\n")
        rows = out.splitlines()[:-1]
        self.assertEqual(len(rows), 2 + len(coverage.transformer_classes()) + 1)  # header, a row per class, summary

    def test_the_package_command_prints_the_same(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(cli.main(["families"]), 0)
        self.assertEqual(out.getvalue(), surgery_cli.listing() + "\n")

    def test_rebuild_plans_each_class_anew(self):
        from surgery.core import registry

        classes = [diffusers.WanTransformer3DModel, diffusers.AnyFlowFARTransformer3DModel]
        out = io.StringIO()
        # AnyFlow-FAR's family taken away: a class that plans but that no registered family proves
        unregistered = {k: v for k, v in registry._families.items() if k != "anyflow-far"}
        with mock.patch.object(coverage, "transformer_classes", return_value=classes), contextlib.redirect_stdout(out), \
                mock.patch.dict(registry._families, unregistered, clear=True):
            self.assertEqual(cli.main(["families", "--rebuild"]), 0)
        rows = out.getvalue().splitlines()
        wan = W.families()["wan"]
        # per Wan block, from the plan's intent: self- and cross-attention, each its output (1) and its q/k norms
        # across heads (2), and the feed-forward's output (1)
        self.assertEqual(rows[2], f"| WanTransformer3DModel | wan | sharded | {wan.tp.all_reduces(wan.config())} "
                                  "| WanTransformerBlock 7 |  |  |")
        # it plans (on DTensors or its twin), but no family registers it, so nothing proved it
        self.assertTrue(rows[3].startswith("| AnyFlowFARTransformer3DModel |  | planned, unproven | "), rows[3])

    def test_a_world_without_rebuild_is_a_usage_error(self):
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
            cli.main(["families", "--world", "4"])
        self.assertIn("add --rebuild", err.getvalue())


@pytest.mark.heavy  # every class built on meta and planned (minutes): the proof's plan-step columns (status,
def test_the_proofs_plan_step_is_the_codes():  # all-reduces per forward, reason) are what the code plans now
    for row, cls in zip(surgery_cli.read_proof()["classes"], coverage.transformer_classes()):
        now = coverage.class_status(cls)
        assert {k: row[k] for k in now} == now, cls.__name__
