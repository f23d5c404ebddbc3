"""The benchmark scripts run (smoke sizes). Their times are for people to judge and never asserted; their counts
(GEMMs, cats, all-reduces per forward on each rank) and errors are."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import pytest

import surgery
from surgery.testing import FP32_TOL

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "flux2.py"


class Smoke(unittest.TestCase):
    @pytest.mark.heavy  # the whole benchmark script at smoke size (~30 s): CI's second run
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


class PerRankWorkSmoke(unittest.TestCase):
    """`benchmarks/per_rank_work.py` on 2 gloo ranks at a tiny FLUX.2 width: every form matches the fused model, and
    per rank surgery's TP does diffusers' packed TP's work."""

    def test_two_ranks_count_and_match(self):
        with tempfile.TemporaryDirectory() as out:
            rows_file = Path(out) / "rows.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(BENCHMARKS / "per_rank_work.py"), "--width", "tp_wide", "--tokens", "16", "--warmup", "0",
                       "--repeat", "1", "--no-compile", "--json", str(rows_file)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            rows = {row["form"]: row for row in json.loads(rows_file.read_text())["rows"]}
        self.assertEqual(set(rows), {"fused", "unfused", "surgery TP", "packed TP"})
        for form, row in rows.items():
            self.assertLess(row["error"], FP32_TOL, form)
        ours, packed = rows["surgery TP"], rows["packed TP"]
        self.assertGreater(packed["collective"], 0)
        self.assertEqual((ours["gemm"], ours["cat"], ours["collective"]),
                         (packed["gemm"], packed["cat"], packed["collective"]))
        self.assertEqual((rows["unfused"]["gemm"], rows["unfused"]["cat"]), (rows["fused"]["gemm"], rows["fused"]["cat"]))
