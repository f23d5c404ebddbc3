"""The benchmark script runs (smoke sizes); its numbers are for people to judge, not asserted here."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "flux2.py"


class Smoke(unittest.TestCase):
    def test_smoke_run_writes_every_section(self):
        with tempfile.TemporaryDirectory() as out:
            result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", out],
                                    capture_output=True, text=True, timeout=600)
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            data = json.loads((Path(out) / "flux2-cpu-smoke.json").read_text())
            markdown = (Path(out) / "flux2-cpu-smoke.md").read_text()
        for section in ("single device", "unfuse cost", "tensor parallel (CPU, gloo)", "memory per rank on paper"):
            self.assertTrue(data[section], section)
            self.assertIn(f"## {section}", markdown)
        self.assertEqual({row["world"] for row in data["tensor parallel (CPU, gloo)"]}, {1, 2})
        self.assertIn("torch", data["machine"])
