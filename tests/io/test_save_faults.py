"""Saving a tensor-parallel model when something goes wrong (issue 18): on every rank at once, the failing rank and
its own error named, the destination as it was, no temporary files left, nothing waiting for a timeout but the
handshake's own (world 2, one spawned job for every case; see save_fault_worker)."""

import functools
import shutil
import tempfile
import unittest
from pathlib import Path

import save_fault_worker
from surgery.testing import run_on_cpu_ranks

# Far below the process group's 60 s in the worker: an answer, not a rank left waiting.
PROMPT_S = save_fault_worker.HANDSHAKE_S + 10


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="surgery-save-faults-"))
    try:
        return run_on_cpu_ranks(save_fault_worker.run, 2, str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


class SaveFaults(unittest.TestCase):
    # case -> (rank 0's error, rank 1's error); None: no error
    EXPECTED = {
        "pipeline_root": (r"^SurgeryError: surgery.save_pretrained: ranks 0, 1: '.*pipeline' is a pipeline folder "
                          r"\(it holds model_index.json\).*Pass its model folder, e.g. '.*pipeline/transformer'", None),
        "file_on_one_rank": (r"^SurgeryError: surgery.save_pretrained: rank 1: destination '.*a-file' is a file, not "
                             r"a folder.* \(rank 0 stopped with it\)$", None),
        "different_names": (r"^SurgeryError: surgery.save_pretrained: rank 1: its folder '.*model1' is not rank 0's "
                            r"\(named 'model0'\): pass the same folder on every rank", None),
        "different_parents": (r"^SurgeryError: surgery.save_pretrained: rank 1: it does not see the temporary "
                              r"folder rank 0 created .*on a file system that every rank shares", None),
        "disk_full_rank_1": (r"^SurgeryError: surgery.save_pretrained: rank 1 failed while writing \('.*model' is as it "
                             r"was, the temporary folder removed\): OSError: \[Errno 28\] No space left on device: "
                             r"'/disk/x' \(rank 0 stopped with it\)$", None),
        "interrupt_rank_1": (r"^SurgeryError: surgery.save_pretrained: rank 1 failed while writing .*: KeyboardInterrupt "
                             r"\(rank 0 stopped with it\)$", r"^KeyboardInterrupt"),
        "write_fails_rank_0": (r"^SurgeryError: surgery.save_pretrained: rank 0 failed while writing .*: OSError: "
                               r"\[Errno 27\] File too large: '.*' \(rank 1 stopped with it\)$", None),
        "rank_0_only": (r"^SurgeryError: surgery.save_pretrained: rank 1 did not call surgery.save_pretrained within "
                        r"3 s \(rank 0 did\)\. Every rank of the group must call it at the same point \(not under "
                        r"`if rank == 0:`\)", "no call"),
        "tp_rank_0_only": (r"^SurgeryError: surgery.tensor_parallel: rank 1 did not call surgery.tensor_parallel within "
                           r"3 s \(rank 0 did\)", "no call"),
        "load_rank_0_only": (r"^SurgeryError: surgery.load_tensor_parallel: rank 1 did not call "
                             r"surgery.load_tensor_parallel within 3 s \(rank 0 did\)", "no call"),
        "cp_rank_0_only": (r"^SurgeryError: surgery.context_parallel: rank 1 did not call surgery.context_parallel "
                           r"within 3 s \(rank 0 did\)", "no call"),
        "lora_rank_0_only": (r"^SurgeryError: surgery.Flux2Transformer2DModel.save_lora_adapter: rank 1 did not call "
                             r"surgery.Flux2Transformer2DModel.save_lora_adapter within 3 s \(rank 0 did\)", "no call"),
        "lora_different_folders": (r"^SurgeryError: surgery.Flux2Transformer2DModel.save_lora_adapter: rank 1 saves "
                                   r"into '.*/lora/a1', rank 0 into '.*/lora/a0'; nothing was written. Pass the same "
                                   r"folder on every rank \(rank 0 writes it\).$", None),
        "lora_different_names": (r"^SurgeryError: surgery.Flux2Transformer2DModel.load_lora_adapter: rank 1 loads the "
                                 r"adapter as 'y1', rank 0 as 'y0'; nothing was loaded. Pass the same adapter_name on "
                                 r"every rank.$", None),
        "lora_save_no_such_adapter_on_rank_1": (
            r"^SurgeryError: surgery.Flux2Transformer2DModel.save_lora_adapter: rank 1: "
            r"Flux2Transformer2DModel.save_lora_adapter: the model has no LoRA adapter named 'nope' \(it has \['x'\]\)"
            r".* \(rank 0 stopped with it\)$", None),
        "lora_save_different_adapters": (r"^SurgeryError: surgery.Flux2Transformer2DModel.save_lora_adapter: rank 1 "
                                         r"saves the adapter 'z', rank 0 'x'; nothing was written. Pass the same "
                                         r"adapter_name on every rank.$", None),
        "lora_disk_full_rank_0": (r"^SurgeryError: surgery.Flux2Transformer2DModel.save_lora_adapter: rank 0 failed "
                                  r"while writing the adapter \('.*/lora/adapter' is as it was\): SafetensorError: .*File too large "
                                  r"\(os error 27\) \(rank 1 stopped with it\)$", None),
    }

    def test_every_rank_raises_at_once_and_nothing_is_left_behind(self):
        per_rank = results()
        for case, (pattern_0, pattern_1) in self.EXPECTED.items():
            with self.subTest(case):
                first, second = (r[case] for r in per_rank)
                self.assertRegex(first["error"] or "", pattern_0)
                if pattern_1 is None:  # the very same message on every rank
                    self.assertEqual(second["error"], first["error"])
                elif pattern_1 == "no call":
                    self.assertIsNone(second["error"])
                else:
                    self.assertRegex(second["error"], pattern_1)
                for rank, r in enumerate(per_rank):
                    self.assertLess(r[case]["seconds"], PROMPT_S, f"rank {rank}")
                self.assertFalse(first["changed"], "the destination's folder changed")
                for rank, r in enumerate(per_rank):  # each rank where it wrote
                    self.assertEqual(r[case]["leftovers"], [], f"rank {rank}")

    def test_a_handshake_that_timed_out_leaves_the_next_call_in_step(self):
        first, second = (r["both_after"] for r in results())
        self.assertIsNone(first["error"])
        self.assertIsNone(second["error"])
        self.assertIn("config.json", first["written"])
        self.assertEqual(first["leftovers"], [])

    def test_collective_verbs_on_some_ranks_only_raise_and_the_next_call_meets(self):
        for rank, r in enumerate(results()):
            for case in ("tp_both_after", "load_both_after", "cp_both_after", "lora_both_after"):
                self.assertIsNone(r[case]["error"], f"rank {rank} {case}")
            self.assertEqual(r["tp_both_after"]["sharded"], "DTensor")

    def test_a_refused_adapter_load_loads_nothing(self):
        for rank, r in enumerate(results()):
            self.assertEqual(r["lora_different_names"]["adapters"], ["x"], f"rank {rank}")

    def test_files_the_save_does_not_own_are_kept(self):
        keep = results()[0]["keep"]
        self.assertIsNone(keep["error"])
        mine = ["README.md", "pytorch_lora_weights.safetensors", "samples", "samples/a.png"]
        self.assertEqual(keep["files"], sorted(mine + keep["stock_files"]))  # the old shards are gone


if __name__ == "__main__":
    unittest.main()
