"""Ranks agree before the first collective: a refusal or a difference on one rank raises the same SurgeryError on
every rank, within seconds, and leaves every model as it was (world 2, one spawned job for all cases)."""

import functools
import unittest

from surgery.testing import run_on_cpu_ranks
import agreement_worker

# Far below the cases' process-group timeout (agreement_worker.TIMEOUT_S): an answer, not a rank left waiting.
PROMPT_S = 10
from surgery.testing import FP32_TOL


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_cpu_ranks(agreement_worker.run, 2)


class Agreement(unittest.TestCase):
    EXPECTED = {
        "refuses": r"^surgery.tensor_parallel: rank 1: 'transformer_blocks.0.ff' is still a fused Flux2FeedForward.*"
        r"\(rank 0 stopped with it\)$",
        "weights": r"rank 1: 'context_embedder.weight' holds other values than rank 0's \(sampled checksum [0-9a-f]+ vs "
        r"[0-9a-f]+\).*load the same checkpoint",
        "config": r"the ranks hold different models, so none of them went on: rank 1: mlp_ratio=3.0, rank 0 "
        r"mlp_ratio=2.5. Every rank must build the model from the same config.$",
        "dtype": r"rank 1: '[\w.]+' has shape \(\d+(, \d+)*\), dtype torch.bfloat16, rank 0 shape \(\d+(, \d+)*\), "
        r"dtype torch.float32",
        "meta": r"rank 1: '[\w.]+' is on the meta device; with src_data_rank=0 every rank needs real weights",
        "midway_0": r"rank 1 failed while sharding 'transformer_blocks.1', and every rank put its model back as it was: MemoryError: "
        r"simulated: out of memory while sharding \(rank 0 stopped with it\)",
        "midway_None": r"rank 1 failed while sharding 'transformer_blocks.1', and every rank put its model back as it was: MemoryError",
        "load": r"^surgery.load_tensor_parallel: rank 1: '.*/missing' does not exist",
    }

    def test_every_rank_raises_the_same_error_at_once_and_keeps_its_model(self):
        per_rank = results()
        for case, pattern in self.EXPECTED.items():
            with self.subTest(case):
                errors = [r[case]["error"] for r in per_rank]
                self.assertIsNotNone(errors[0])
                self.assertRegex(errors[0], pattern)
                self.assertEqual(errors[1], errors[0])  # the very same message on every rank
                for rank, r in enumerate(per_rank):
                    self.assertLess(r[case]["seconds"], PROMPT_S, f"rank {rank}")
                    self.assertTrue(r[case]["intact"], f"rank {rank}: model changed")
                    self.assertEqual(r[case]["leftovers"], [], f"rank {rank}")

    def test_ranks_in_different_verbs_name_each_other(self):
        called = ["tensor_parallel", "save_pretrained"]
        for rank, r in enumerate(results()):
            with self.subTest(rank=rank):
                self.assertEqual(r["verbs"]["error"],
                                 f"surgery.{called[rank]}: rank {1 - rank} called surgery.{called[1 - rank]} where this "
                                 f"rank called surgery.{called[rank]}: every rank must call surgery's collective verbs "
                                 "in the same order.")
                self.assertLess(r["verbs"]["seconds"], PROMPT_S)
                self.assertEqual(r["verbs"]["collectives"], {"allgather_": 2})  # the verdict exchange, nothing after

    def test_shard_lora_on_one_rank_raises_there_naming_the_other(self):
        alone = results()[0]["shard_lora_alone"]
        self.assertRegex(alone["error"] or "", r"^surgery.lora.shard_lora: rank 1 did not call surgery.lora.shard_lora within 2 s "
                                               r"\(rank 0 did\)")
        self.assertLess(alone["seconds"], PROMPT_S)
        self.assertTrue(alone["intact"])
        self.assertEqual(alone["collectives"], {})  # nothing but the store's handshake

    def test_a_refusal_runs_no_collective_but_the_agreement(self):
        # "before the first collective", counted: a call refused on any rank issues only the agreement's exchanges
        # (each an all_gather_object: two allgathers, sizes then data), never a weight broadcast, scatter or
        # all-reduce. A refusal takes the verdict exchange alone; a difference also the differing part's exchange.
        expected = {"refuses": 2, "meta": 2, "weights": 4, "config": 4, "dtype": 4}
        for case, allgathers in expected.items():
            for rank, r in enumerate(results()):
                with self.subTest(case=case, rank=rank):
                    self.assertEqual(r[case]["collectives"], {"allgather_": allgathers})

    def test_a_model_rolled_back_after_a_midway_failure_shards_again(self):
        for r in results():
            for src in (0, None):
                self.assertLessEqual(r[f"midway_{src}"]["retry"], FP32_TOL)


if __name__ == "__main__":
    unittest.main()
