"""Training a LoRA under TP 2 x FSDP2 2 (4 gloo ranks): examples/train_lora_tp.py's core against the same steps on one
device, and the saved adapter in stock diffusers. One spawned job (tests/workers/lora_train_worker.py)."""

import pytest
import functools
import tempfile
import unittest

from surgery.testing import run_on_cpu_ranks
import lora_train_worker

pytestmark = pytest.mark.heavy  # the heavy tier: CI's second command (tests/conftest.py)

from surgery.testing import FP32_GRAD_TOL, FP32_TOL


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="surgery-lora-train-") as shared:
        return run_on_cpu_ranks(lora_train_worker.run, 4, shared)


class LoraOnTensorParallelTimesFSDP2(unittest.TestCase):
    def test_steps_match_one_device_and_a_skipped_step_would_not(self):
        for rank, result in enumerate(results()):
            for optimizer in ("sgd", "adamw"):  # AdamW with eps=0.1: its step is nearly linear in the gradient
                with self.subTest(rank=rank, optimizer=optimizer):
                    r = result[optimizer]
                    self.assertLessEqual(r["trained"], FP32_GRAD_TOL)
                    self.assertGreater(r["skipped step"], 100 * FP32_TOL)
                    self.assertGreater(r["factors"], 40)
                    # lora_B of colwise bases: rows over "tp", FSDP2 over "dp"; lora_A of colwise bases replicated
                    # over "tp"
                    self.assertIn("(_StridedShard(dim=0, sf=2), Shard(dim=0))", r["placements"])
                    self.assertIn("(Shard(dim=0), Replicate())", r["placements"])

    def test_saved_adapter_loads_in_stock_diffusers(self):
        r = results()[0]
        self.assertLessEqual(r["stock load of the saved adapter"], FP32_TOL)
        self.assertGreater(r["adapter changes the output"], 1e-3)


if __name__ == "__main__":
    unittest.main()
