"""Checkpoints stay in diffusers' layout: unfused and tensor-parallel models save what the stock model saves."""

import copy
import hashlib
import inspect
import os
import shutil
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch
from diffusers import Flux2Transformer2DModel
from parameterized import parameterized
from safetensors.torch import load_file

import save_worker
import surgery
from surgery.testing import run_on_cpu_ranks
from flux2_testing import build, inputs, rel_err, small_config
from surgery.io import safetensors_writer

from surgery.testing import FP32_TOL


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def loaded_state(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return Flux2Transformer2DModel.from_pretrained(folder, torch_dtype=dtype).state_dict()


class SaveLoad(unittest.TestCase):
    def setUp(self):
        self.root = Path(tempfile.mkdtemp(prefix="surgery-save-"))

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def assert_stock_state(self, folder: Path, fused: torch.nn.Module):
        got = loaded_state(folder, fused.dtype)
        want = fused.state_dict()
        self.assertEqual(list(got), list(want))
        for key, value in want.items():
            self.assertEqual(got[key].dtype, value.dtype, key)
            self.assertTrue(torch.equal(got[key], value), key)

    @parameterized.expand([("fp32", torch.float32, {}), ("bf16_sharded", torch.bfloat16, {"max_shard_size": "50KB"}),
                           ("fp16_variant", torch.float16, {"variant": "fp16"})])
    def test_save_pretrained_of_the_unfused_model_is_the_stock_files(self, _, dtype, kwargs):
        fused = build(small_config("klein9b_small"), 0, dtype)
        unfused = surgery.unfuse(copy.deepcopy(fused))
        fused.save_pretrained(self.root / "stock", **kwargs)
        unfused.save_pretrained(self.root / "unfused", **kwargs)
        self.assertEqual(digests(self.root / "unfused"), digests(self.root / "stock"))  # bitwise, same shards
        surgery.save_pretrained(unfused, self.root / "surgery", **kwargs)
        self.assertEqual(digests(self.root / "surgery"), digests(self.root / "stock"))  # its own writer, same bytes
        if "variant" not in kwargs:
            for folder in ("unfused", "surgery"):
                self.assert_stock_state(self.root / folder, fused)
        # the model is untouched: still unfused, state_dict() keys are its parameters' names
        self.assertEqual(list(unfused.state_dict()), list(dict(unfused.named_parameters())))

    def test_diffusers_round_trip_patterns(self):
        """diffusers' model tests: save, `from_pretrained`, same outputs; `load_state_dict` of either layout."""
        config = small_config("dev_small")
        fused = build(config, 1)
        unfused = surgery.unfuse(copy.deepcopy(fused))
        kw = inputs(config, 1)
        unfused.save_pretrained(self.root / "a")
        with torch.no_grad():
            expected = unfused(**kw).sample
            self.assertLessEqual(rel_err(Flux2Transformer2DModel.from_pretrained(self.root / "a")(**kw).sample,
                                         expected), FP32_TOL)
        for source in (fused.state_dict(), unfused.state_dict(), load_file(self.root / "a" /
                                                                           "diffusion_pytorch_model.safetensors")):
            other = surgery.unfuse(build(config, 2))
            self.assertEqual(other.load_state_dict(source, strict=True).missing_keys, [])
            for key, value in unfused.state_dict().items():
                self.assertTrue(torch.equal(other.state_dict()[key], value), key)
        # a pipeline passes keyword arguments that the method's signature names
        self.assertIn("max_shard_size", inspect.signature(unfused.save_pretrained).parameters)
        # fuse removes the overrides: back to the class's methods
        surgery.fuse(unfused)
        self.assertNotIn("save_pretrained", vars(unfused))
        self.assertNotIn("load_lora_adapter", vars(unfused))

    def test_a_failed_save_leaves_the_folder_as_it_was(self):
        fused = build(small_config("klein4b_small"), 0)
        unfused = surgery.unfuse(copy.deepcopy(fused))
        surgery.save_pretrained(fused, self.root / "model")
        before = digests(self.root / "model")
        calls = []

        def fail_on_second(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise OSError("disk full")
            return real(*args, **kwargs)

        real = safetensors_writer.write_file
        with mock.patch.object(safetensors_writer, "write_file", fail_on_second), \
                self.assertRaisesRegex(surgery.SurgeryError, "cannot write .*disk full"):
            surgery.save_pretrained(unfused, self.root / "model", max_shard_size="30KB")
        self.assertEqual(digests(self.root / "model"), before)
        self.assertEqual(sorted(p.name for p in self.root.iterdir()), ["model"])  # no temporary folder left
        surgery.save_pretrained(unfused, self.root / "model", max_shard_size="30KB")  # replaces it when complete
        self.assert_stock_state(self.root / "model", fused)
        with self.assertRaisesRegex(surgery.SurgeryError, "not a diffusers model"):
            surgery.save_pretrained(torch.nn.Linear(2, 2), self.root / "x")

    def test_tensor_parallel_round_trips_world_2(self):
        """One spawned job: fp32 and bf16, sharded in memory and loaded sharded; plus LoRA on the TP model."""
        results = run_on_cpu_ranks(save_worker.all_checks, 2, str(self.root))
        main = results[0]
        for key in ("float32", "bfloat16"):
            case = main[key]
            self.assertEqual(case["tp"], [], key)  # every tensor bitwise, read by stock from_pretrained
            self.assertEqual(case["tp-method"], [], key)
            self.assertEqual(case["tp-loaded"], [], key)
            self.assertEqual(case["files"], case["stock_files"], key)
            self.assertEqual(case["index"], case["stock_index"], key)
            self.assertEqual(case["leftovers"], [], key)
        for result in results:
            self.assertIn("surgery.save_pretrained", result["push_to_hub_error"])
            self.assertFalse(result["push_to_hub_folder"])
            self.assertLessEqual(result["lora_merged_before_sharding"], FP32_TOL)
            self.assertLessEqual(result["lora_vs_trained"], FP32_TOL)
            self.assertLessEqual(result["lora_after_sharding"], FP32_TOL)


class SaveMemory(unittest.TestCase):
    """A 150 MB model saved twice from 2 ranks: each rank's peak is its kernel high-water mark during the save."""

    def test_each_rank_holds_about_one_or_two_tensors_not_its_shard(self):
        root = Path(tempfile.mkdtemp(prefix="surgery-save-"))
        try:
            results = run_on_cpu_ranks(save_worker.peak_memory, 2, str(root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for rank, r in enumerate(results):
            mb = {k: f"{v / 2**20:.1f} MB" for k, v in r.items()}
            print(f"\nrank {rank}: peak {mb['peak']} above the start while saving (VmHWM); holds {mb['local_bytes']}; "
                  f"largest tensor {mb['largest_tensor']}; checkpoint {mb['checkpoint']}")
            # rank 0 also runs torch's consolidation, which holds about two of the largest tensor; and torch's writer
            # copies a shard that is a view into a leaf's packed buffer (one GEMM per fused weight) before writing it,
            # one at a time: a third
            self.assertLess(r["peak"], 3 * r["largest_tensor"] + 8 * 2**20)
            self.assertLess(r["peak"], r["local_bytes"] / 2)


class OneWriter(unittest.TestCase):
    """`save_pretrained` and `convert_checkpoint` write every safetensors file through one writer, which fsyncs each
    file once it is whole and lays it out byte for byte as safetensors does."""

    def setUp(self):
        self.root = Path(tempfile.mkdtemp(prefix="surgery-writer-"))
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def test_save_and_convert_both_write_through_it_and_fsync_each_file(self):
        build(small_config("klein4b_small"), 0).save_pretrained(self.root / "stock")  # diffusers' own writer
        unfused = surgery.unfuse(build(small_config("klein4b_small"), 1))
        real_write, real_fsync = safetensors_writer.write_file, os.fsync
        written: list[Path] = []
        synced: dict[tuple[int, int], int] = {}  # (device, inode) -> size when fsynced inside write_file
        inside = []

        def write_file(path, *args):
            inside.append(path)
            try:
                real_write(path, *args)
            finally:
                inside.pop()
            written.append(path)

        def fsync(fd):
            if inside:
                info = os.fstat(fd)
                synced[info.st_dev, info.st_ino] = info.st_size
            return real_fsync(fd)

        with mock.patch.object(safetensors_writer, "write_file", write_file), mock.patch.object(os, "fsync", fsync):
            surgery.save_pretrained(unfused, self.root / "saved", max_shard_size="30KB")
            saved = len(written)
            surgery.state_dict.convert_checkpoint(self.root / "stock", self.root / "converted", max_shard_size="30KB")
        outputs = {"saved": written[:saved], "converted": written[saved:]}
        for folder, paths in outputs.items():
            files = sorted((self.root / folder).glob("*.safetensors"))
            self.assertGreater(len(files), 2, folder)  # sharded
            self.assertEqual(sorted(p.name for p in paths), [f.name for f in files], folder)
            for file in files:  # the very file (renamed with its folder since), fsynced whole, by the writer itself
                info = file.stat()
                self.assertEqual(synced.get((info.st_dev, info.st_ino)), info.st_size, file)

    def test_a_file_is_what_safetensors_writes(self):
        """Mixed dtypes (safetensors orders them by dtype, then name), a non-ASCII name, a scalar, an empty tensor,
        and a tensor joined from column parts in several blocks."""
        from safetensors.torch import save

        generator = torch.Generator().manual_seed(0)
        left, right = torch.randn(40, 3, generator=generator), torch.randn(40, 5, generator=generator)
        tensors = {"b": torch.randn(7, 3, generator=generator).to(torch.bfloat16),
                   "a": torch.randn(4, generator=generator).to(torch.float16),
                   "z": torch.arange(5, dtype=torch.int64), "y": torch.randn(2, 2, dtype=torch.float64),
                   "nü": torch.randn(3, generator=generator), "s": torch.tensor(2.5), "e": torch.empty(0, 4),
                   "flag": torch.tensor([True, False]), "i8": torch.tensor([-1, 2], dtype=torch.int8),
                   "joined": torch.cat([left, right], 1)}

        def part(t):
            return safetensors_writer.Part(t.shape[0] if t.dim() else 0, lambda rows: t if rows is None else t[rows])

        entries = [safetensors_writer.Entry(name, t.dtype, tuple(t.shape), (part(t),))
                   for name, t in tensors.items() if name != "joined"]
        entries.append(safetensors_writer.Entry("joined", torch.float32, (40, 8), (part(left), part(right)), 1))
        with mock.patch.object(safetensors_writer, "BLOCK_BYTES", 64):  # two rows a block
            safetensors_writer.write_file(self.root / "x.safetensors", entries, {"format": "pt"})
        self.assertEqual((self.root / "x.safetensors").read_bytes(), save(tensors, metadata={"format": "pt"}))


class QKVFusionRoundTrip(unittest.TestCase):
    def test_unfuse_qkv_projections_between_unfuse_and_fuse_ends_as_on_the_stock_model(self):
        config = small_config("klein9b_small")
        kw = inputs(config, 0)
        stock = build(config, 0)
        stock.fuse_qkv_projections()
        stock.unfuse_qkv_projections()
        ours = build(config, 0)
        ours.fuse_qkv_projections()
        surgery.unfuse(ours)
        ours.fuse_qkv_projections()  # already fused, as diffusers sees it: no-op
        ours.unfuse_qkv_projections()
        surgery.fuse(ours)
        self.assertEqual([(n, type(m)) for n, m in ours.named_modules()],
                         [(n, type(m)) for n, m in stock.named_modules()])
        self.assertEqual(ours.state_dict().keys(), stock.state_dict().keys())
        for key, value in stock.state_dict().items():
            self.assertTrue(torch.equal(ours.state_dict()[key], value), key)
        self.assertFalse(ours.transformer_blocks[0].attn.fused_projections)
        with torch.no_grad():
            self.assertEqual(rel_err(ours(**kw).sample, stock(**kw).sample), 0.0)


if __name__ == "__main__":
    unittest.main()
