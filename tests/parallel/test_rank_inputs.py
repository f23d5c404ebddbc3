"""Inputs that every shape check passes but whose values differ by layout or by rank must shard exactly or be
refused on every rank (world 2, one spawned job for all cases)."""

import atexit
import functools
import shutil
import tempfile
import unittest

from surgery.testing import FP32_GRAD_TOL, FP32_TOL, run_on_cpu_ranks
import rank_inputs_worker


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    root = tempfile.mkdtemp(prefix="surgery-rank-inputs-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return run_on_cpu_ranks(rank_inputs_worker.run, 2, root)


class TransposedStorage(unittest.TestCase):
    """Every Linear's weight stored column-major: the same values, other strides. A shard received in place of a
    strided one was written in memory order (0.59 off with src_data_rank=0)."""

    def test_sharded_model_matches_the_single_device_one(self):
        for rank, r in enumerate(results()):
            for src in (0, None):
                with self.subTest(rank=rank, src_data_rank=src):
                    case = r[f"transposed_{src}"]
                    self.assertGreater(case["compared"], 20)
                    self.assertLess(case["forward"], FP32_TOL)
                    self.assertLess(case["grad"], FP32_GRAD_TOL)


class FilterKeepsHeadNormsWhole(unittest.TestCase):
    """A q/k norm kept whole while its projections are sharded runs on each rank's heads: a right forward, and a
    weight gradient of those heads alone (0.98 off before it was refused)."""

    def test_refused_on_every_rank_naming_the_norm_and_the_model_kept(self):
        errors = [r["norms_whole"]["error"] for r in results()]
        # refused as half a planned module: the norms' SequenceParallel is what sums their gradient over the ranks
        self.assertRegex(errors[0] or "", r"filter_fn shards .*of 'transformer_blocks\.0\.attn' \(\w+\) but leaves "
                                          r"its partners 'norm_q' \(SequenceParallel\).* whole; half a sharded module "
                                          r"computes with mismatched shapes or wrong gradients")
        self.assertEqual(errors[1], errors[0])

    def test_attention_kept_whole_with_its_norms_shards_and_trains_right(self):
        for rank, r in enumerate(results()):
            with self.subTest(rank=rank):
                self.assertIsNone(r["attention_whole"]["error"])
                self.assertLess(r["attention_whole"]["grad"], FP32_GRAD_TOL)


class WrappedProcessorAfterUnfuse(unittest.TestCase):
    """The way out that the refusal of a wrapped stock processor names: the wrapper set after `unfuse` runs the
    head-dim twin it installs, and the sharded model computes the user's model (Sana: 0.195 off when the wrapper
    around the stock processor was sharded)."""

    def test_sharded_equals_the_users_model(self):
        for rank, r in enumerate(results()):
            with self.subTest(rank=rank):
                self.assertTrue(r["sana_wrapped"]["wrapped"])
                self.assertTrue(all(n.startswith("HeadDim") for n in r["sana_wrapped"]["wrapped"]))  # the twins
                self.assertLess(r["sana_wrapped"]["forward"], FP32_TOL)


class RanksGivenDifferentData(unittest.TestCase):
    """Ranks compare what they read (each file's size and a digest of its header and samples of its bytes; an
    adapter's file or tensors; with src_data_rank=None the starting LoRA factors) before anything is used: a
    difference raises the same error on every rank, naming the file and the ranks (before: each case loaded, and the
    ranks computed different things)."""

    SAME_FILE = ("the ranks read different data, so none of them went on: rank 1 read '{0}' \\(\\d+ bytes, digest "
                 "\\w+\\), rank 0 read '{0}' \\(\\d+ bytes, digest \\w+\\). Every rank must read the same checkpoint")
    EXPECTED = {
        "folder": SAME_FILE.format("diffusion_pytorch_model.safetensors"),
        "gguf": SAME_FILE.format("model.gguf"),
        "fp8": SAME_FILE.format("model.safetensors"),
        "replaced": SAME_FILE.format("model.safetensors"),
        "gguf_or_fp8": r"rank 1 did not read 'model.gguf', rank 0 read 'model.gguf' \(\d+ bytes",
        "adapter": SAME_FILE.replace("bytes,", "bytes of tensors,").format("pytorch_lora_weights.safetensors"),
        "shard_lora": r"rank 1: '[\w.]+\.lora_A\.trained\.weight' holds other values than rank 0's",
    }

    def test_every_rank_raises_the_same_error_naming_the_file(self):
        per_rank = [r["different_data"] for r in results()]
        for case, pattern in self.EXPECTED.items():
            with self.subTest(case):
                self.assertRegex(per_rank[0][case] or "", pattern)
                self.assertEqual(per_rank[1][case], per_rank[0][case])

    def test_ranks_reading_one_file_load_it_and_a_refused_adapter_leaves_none(self):
        for rank, r in enumerate(results()):
            with self.subTest(rank=rank):
                self.assertIsNone(r["different_data"]["same_fp8"])
                self.assertEqual(r["different_data"]["adapter_left"], [])
                self.assertTrue(r["different_data"]["shard_lora_kept"])
