"""`benchmarks/per_rank_work.py`, the script a lent GPU runs (FLUX.2-klein-9B and Wan-14B widths), smoke-run on CPU at
its tiny size: every form it measures matches the fused model. Times are printed by the script, never asserted."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from surgery.testing import FP32_TOL

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class TinyDeviceRun(unittest.TestCase):
    def test_wan_tiny_on_cpu(self):
        with tempfile.TemporaryDirectory() as out:
            rows_file = Path(out) / "rows.json"
            command = [sys.executable, str(BENCHMARKS / "per_rank_work.py"), "--device", "cpu", "--tiny", "--model",
                       "wan", "--warmup", "0", "--repeat", "1", "--no-compile", "--json", str(rows_file)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            rows = {row["form"]: row for row in json.loads(rows_file.read_text())["rows"]}
        # Wan has no diffusers tensor-parallel plan: no packed TP row
        self.assertEqual(set(rows), {"fused", "unfused", "surgery TP"})
        for form, row in rows.items():
            self.assertLess(row["error"], FP32_TOL, form)
            self.assertGreater(row["eager ms"], 0)
        self.assertEqual(rows["unfused"]["gemm"], rows["fused"]["gemm"])
        self.assertIn("wan tiny width: 2 blocks", result.stdout)
