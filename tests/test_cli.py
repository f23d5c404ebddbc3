"""The `surgery` command: the README's main job runs, bad arguments exit non-zero with one line."""

import contextlib
import io
import subprocess
import sys
import unittest

from parameterized import parameterized

from surgery.cli import main


def surgery_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surgery", *args], capture_output=True, text=True, timeout=600)


class Demo(unittest.TestCase):
    def test_demo_runs_and_reports(self):
        result = surgery_command("demo", "--layers", "1", "--single-layers", "2", "--head-dim", "8")
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertIn("to_qkv_mlp_proj: SplitRows", result.stdout)
        self.assertIn("collectives per forward: 6 all_reduce", result.stdout)
        self.assertIn("OK: worst error", result.stdout)


class BadArguments(unittest.TestCase):
    @parameterized.expand([
        (["demo", "--tp", "5"], "--tp 5 does not divide the 24 heads of flux2-klein-4b"),
        (["demo", "--model", "klein-9b", "--tp", "5"], "--tp 5 does not divide the 32 heads of klein-9b"),
        (["demo", "--head-dim", "12"], "head_dim 12 is not a multiple of 8"),
        (["demo", "--tp", "0"], "must be at least 1"),
        (["demo", "--model", "flux9"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ])
    def test_exit_two_with_one_line(self, args, message):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
            main(args)
        self.assertEqual(exit_.exception.code, 2)
        self.assertIn(message, stderr.getvalue().strip().splitlines()[-1])
