"""QLoRA-style: peft LoRA adapters on a FLUX.2 model unfused, quantized (torchao int8) and sharded (2 gloo ranks),
against the same quantized model with the same adapters on one process."""

import functools
import tempfile
import unittest

from surgery.testing import FP32_TOL, run_on_cpu_ranks
import qlora_tp_worker


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    with tempfile.TemporaryDirectory() as shared:
        return run_on_cpu_ranks(qlora_tp_worker.run, 2, shared)


class QuantizedShardedLoRA(unittest.TestCase):
    def test_base_is_quantized_and_sharded(self):
        for result in results():
            self.assertNotIn("error", result, result.get("error"))
            self.assertGreater(result["quantized shards"], 0)

    def test_load_and_switch_adapters(self):
        for rank, result in enumerate(results()):
            for label in ("one", "two", "one+two"):
                self.assertLessEqual(result[f"load and switch: {label}"], FP32_TOL, (rank, label))

    def test_adapter_gradients(self):
        for rank, result in enumerate(results()):
            whole, sharded = result["trained factors"]
            self.assertEqual(whole, sharded)
            self.assertGreater(whole, 0)
            self.assertLessEqual(result["train: gradients"], FP32_TOL, rank)
