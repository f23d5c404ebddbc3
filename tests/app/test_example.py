"""The torchrun example runs end to end on CPU (2 gloo ranks) on a tiny pipeline saved with save_pretrained."""

import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

import pipeline_testing as P

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flux2_klein_tp.py"
ARGS = ["--device", "cpu", "--steps", "1", "--height", "32", "--width", "32", "--dtype", "float32", "--seed", "3"]


class TorchrunExample(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.folder = Path(cls.tmp.name) / "klein-tiny"
        pipe = P.klein_pipeline(0, text_layers=27)
        pipe.save_pretrained(cls.folder)
        generator = torch.Generator().manual_seed(3)
        cls.expected = np.asarray(pipe(prompt="a lighthouse on a cliff at dusk, oil painting", height=32, width=32,
                                       num_inference_steps=1, generator=generator).images[0], dtype=np.int16)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_two_ranks_save_the_single_device_image_sharded_load(self):
        self.check_image([])

    @pytest.mark.heavy  # a second torchrun of the same pipeline (~20 s): CI's second run
    def test_two_ranks_save_the_single_device_image_full_load(self):
        self.check_image(["--full-load"])

    def check_image(self, extra):
        out = Path(self.tmp.name) / f"image{len(extra)}.png"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(EXAMPLE), "--model", str(self.folder), "--out", str(out), *ARGS, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(EXAMPLE.parent.parent))
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        image = np.asarray(PIL.Image.open(out), dtype=np.int16)
        self.assertLessEqual(np.abs(image - self.expected).max(), 1)  # 8-bit PNG: at most a rounding step
