"""Sharded loading: each rank reads only its slices; the converter; bad checkpoints."""

import functools
import json
import os
import shutil
import tempfile
import unittest
from pathlib import Path

import torch
from parameterized import parameterized
from safetensors.torch import load_file, save_file

import load_worker
import surgery
from surgery.testing import run_on_cpu_ranks
from flux2_testing import build, small_config
from surgery.app.cli import main as surgery_main
from surgery.testing import single_rank_group

from surgery.testing import BF16_TOL, FP32_TOL
ROOT = Path(tempfile.mkdtemp(prefix="surgery-load-"))
# name -> (config, seed, dtype, save_pretrained kwargs)
CHECKPOINTS = {
    "tp_wide-fp32-single": ("tp_wide", 3, "float32", {}),
    "klein9b-bf16-sharded": ("klein9b_small", 4, "bfloat16", {"max_shard_size": "60KB"}),
}


def tearDownModule():
    shutil.rmtree(ROOT, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def checkpoint(name: str) -> str:
    config, seed, dtype, kwargs = CHECKPOINTS[name]
    folder = ROOT / name
    build(small_config(config), seed, getattr(torch, dtype)).save_pretrained(folder, **kwargs)
    return str(folder)


@functools.lru_cache(maxsize=None)
def pipeline_folder() -> str:
    """A pipeline layout: model_index.json beside transformer/ (dev-shaped, fp32)."""
    folder = ROOT / "pipeline"
    build(small_config("dev_small"), 5).save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline"}))
    return str(folder)


@functools.lru_cache(maxsize=None)
def hub_cache() -> str:
    """A Hugging Face cache holding repo 'acme/flux2-tiny' at one snapshot, as `huggingface-cli download` leaves it."""
    cache = ROOT / "hub"
    repo = cache / "models--acme--flux2-tiny"
    shutil.copytree(checkpoint("tp_wide-fp32-single"), repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    return str(cache)


@functools.lru_cache(maxsize=None)
def unfused_layout() -> str:
    folder = ROOT / "unfused-layout"
    surgery.state_dict.convert_checkpoint(checkpoint("tp_wide-fp32-single"), folder)
    return str(folder)


@functools.lru_cache(maxsize=None)
def loaded(world: int) -> dict[str, list[dict]]:
    """One job per world size loads every checkpoint; results by checkpoint name, then rank."""
    specs = {name: (checkpoint(name), config, seed, dtype) for name, (config, seed, dtype, _) in CHECKPOINTS.items()}
    if world == 2:
        specs["pipeline"] = (pipeline_folder(), "dev_small", 5, "float32")
        specs["unfused-layout"] = (unfused_layout(), "tp_wide", 3, "float32")
    by_rank = run_on_cpu_ranks(load_worker.compare_all, world, list(specs.values()))
    return {name: [results[i] for results in by_rank] for i, name in enumerate(specs)}


class ShardedLoad(unittest.TestCase):
    @parameterized.expand([(w, name) for w in (2, 4) for name in CHECKPOINTS])
    def test_bitwise_as_unfuse_then_tensor_parallel_and_forward_matches(self, world, name):
        tolerance = FP32_TOL if "fp32" in name else BF16_TOL
        for rank, result in enumerate(loaded(world)[name]):
            self.assertEqual(result["mismatched"], [], f"rank {rank}")
            self.assertLessEqual(result["forward"], tolerance, f"rank {rank}")

    def test_pipeline_folder_uses_its_transformer(self):
        for rank, result in enumerate(loaded(2)["pipeline"]):
            self.assertEqual(result["mismatched"], [], f"rank {rank}")
            self.assertLessEqual(result["forward"], FP32_TOL)

    def test_unfused_layout_loads_sharded(self):
        for rank, result in enumerate(loaded(2)["unfused-layout"]):
            self.assertEqual(result["mismatched"], [], f"rank {rank}")

    def test_repo_id_resolves_to_the_local_cache(self):
        folder = surgery.io.checkpoint.resolve_checkpoint("acme/flux2-tiny", cache_dir=hub_cache())
        self.assertEqual(sorted(os.listdir(folder)), sorted(os.listdir(checkpoint("tp_wide-fp32-single"))))
        with self.assertRaisesRegex(surgery.SurgeryError, "not in the local Hugging Face cache"):
            surgery.io.checkpoint.resolve_checkpoint("acme/absent", cache_dir=hub_cache())


# Peak memory of a sharded load (each rank owns about its shard plus the largest tensor it reads) is measured in
# `benchmarks/loading_memory.py`, not asserted here: a thread sampling what a process owns during a load depends on
# the allocator, the kernel and the machine's load, and missed diffusers' own load peak on a fresh machine.


class Convert(unittest.TestCase):
    def test_round_trip_is_bitwise(self):
        source = checkpoint("klein9b-bf16-sharded")
        with tempfile.TemporaryDirectory() as tmp:
            surgery.state_dict.convert_checkpoint(source, f"{tmp}/unfused")
            self.assertEqual(surgery_main(["convert", f"{tmp}/unfused", f"{tmp}/fused", "--to", "fused"]), 0)
            original = build(small_config("klein9b_small"), 4, torch.bfloat16).state_dict()
            back = load_file(f"{tmp}/fused/diffusion_pytorch_model.safetensors")
            self.assertEqual(back.keys(), original.keys())
            for key, value in original.items():
                self.assertTrue(torch.equal(back[key], value), key)
            unfused = load_file(f"{tmp}/unfused/diffusion_pytorch_model.safetensors")
            model = surgery.unfuse(build(small_config("klein9b_small"), 4, torch.bfloat16))
            self.assertEqual(unfused.keys(), model.state_dict().keys())
            with self.assertRaisesRegex(surgery.SurgeryError, "already in the unfused layout"):
                surgery.state_dict.convert_checkpoint(f"{tmp}/unfused", f"{tmp}/again")


class BadCheckpoints(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from torch.distributed.device_mesh import init_device_mesh

        cls.group = single_rank_group()
        cls.group.__enter__()
        cls.mesh = init_device_mesh("cpu", (1,))

    @classmethod
    def tearDownClass(cls):
        cls.group.__exit__(None, None, None)

    def edited(self, tmp, edit):
        folder = Path(tmp) / "bad"
        shutil.copytree(checkpoint("tp_wide-fp32-single"), folder)
        file = folder / "diffusion_pytorch_model.safetensors"
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file, metadata={"format": "pt"})
        return folder

    def assert_refused(self, folder, pattern):
        with self.assertRaisesRegex(surgery.SurgeryError, pattern):
            surgery.load_tensor_parallel(None, folder, self.mesh, progress=False)

    def test_missing_key(self):
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.edited(tmp, lambda t: t.pop("single_transformer_blocks.1.attn.norm_k.weight"))
            self.assert_refused(folder, r"lacks 1 tensor\(s\) .*'single_transformer_blocks.1.attn.norm_k.weight'")

    def test_missing_fused_key(self):
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.edited(tmp, lambda t: t.pop("transformer_blocks.1.ff.linear_in.weight"))
            self.assert_refused(folder, r"neither the fused nor the unfused layout.*'transformer_blocks.1.ff.linear_in")

    def test_extra_key(self):
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.edited(tmp, lambda t: t.update({"lora.extra": torch.zeros(2)}))
            self.assert_refused(folder, r"1 tensor\(s\) the model has no place for, first 'lora.extra'")

    def test_wrong_shape(self):
        key = "single_transformer_blocks.0.attn.to_out.weight"
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.edited(tmp, lambda t: t.update({key: torch.zeros(64, 100)}))
            self.assert_refused(folder, rf"tensor '{key}' has shape \(64, 100\), the model needs \(64, 224\)")

    def test_bin_checkpoint(self):
        with tempfile.TemporaryDirectory() as tmp:
            build(small_config("tp_wide")).save_pretrained(tmp, safe_serialization=False)
            self.assert_refused(tmp, r"holds no safetensors weights \(found \['diffusion_pytorch_model.bin'\]\)")

    def test_not_a_model_folder(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.assert_refused(tmp, "has no config.json")


def sparse_past_4gib(source: str, folder: Path) -> Path:
    """`source`'s checkpoint rewritten as one indexed shard whose tensors' data all start past 4 GiB: a 4 GiB filler
    tensor (not in the index, so neither diffusers' index nor surgery reads it) comes first, as a hole of a sparse
    file (nothing of it is written), then the real tensors' bytes."""
    import struct

    tensors = load_file(Path(source) / "diffusion_pytorch_model.safetensors")
    filler = 4 * 2**30 + 4096
    header = {"filler": {"dtype": "U8", "shape": [filler], "data_offsets": [0, filler]}}
    offset, order = filler, sorted(tensors)
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": {torch.float32: "F32", torch.bfloat16: "BF16"}[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    folder.mkdir(parents=True)
    shutil.copyfile(Path(source) / "config.json", folder / "config.json")
    shard = "diffusion_pytorch_model-00001-of-00001.safetensors"
    with open(folder / shard, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        f.seek(filler, os.SEEK_CUR)  # the hole
        for name in order:
            f.write(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    index = {"metadata": {"total_size": offset - filler}, "weight_map": {name: shard for name in order}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return folder


class PastFourGiB(unittest.TestCase):
    """A checkpoint whose tensors start past 4 GiB in their file (a sparse file: the first 4 GiB is a hole) loads
    sharded and converts both ways to the very bytes of the same checkpoint written normally."""

    def test_sharded_load_and_convert_read_the_right_bytes(self):
        source = checkpoint("tp_wide-fp32-single")
        with tempfile.TemporaryDirectory() as tmp:
            sparse = sparse_past_4gib(source, Path(tmp) / "sparse")
            self.assertGreater((sparse / "diffusion_pytorch_model-00001-of-00001.safetensors").stat().st_size, 2**32)
            per_rank = run_on_cpu_ranks(load_worker.compare_all, 2, [(str(sparse), "tp_wide", 3, "float32")])
            for rank, (result,) in enumerate(per_rank):  # each rank read its own shards: every rank's are checked
                self.assertEqual(result["mismatched"], [], f"rank {rank}")
                self.assertLessEqual(result["forward"], FP32_TOL, f"rank {rank}")
            surgery.state_dict.convert_checkpoint(sparse, f"{tmp}/unfused")
            surgery.state_dict.convert_checkpoint(source, f"{tmp}/unfused-reference")
            surgery.state_dict.convert_checkpoint(f"{tmp}/unfused", f"{tmp}/fused", to="fused")
            for got, want in ((f"{tmp}/unfused", f"{tmp}/unfused-reference"), (f"{tmp}/fused", source)):
                got = load_file(f"{got}/diffusion_pytorch_model.safetensors")
                want = load_file(f"{want}/diffusion_pytorch_model.safetensors")
                self.assertEqual(got.keys(), want.keys())
                for key in want:
                    self.assertTrue(torch.equal(got[key], want[key]), key)
