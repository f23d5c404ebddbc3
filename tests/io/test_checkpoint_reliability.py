"""Checkpoint files: nothing lost, nothing silent (issue 10), and diffusers' sharded layout from convert (issue 11).

Every refusal is checked to leave every file bitwise as it was (a hash of every file and folder under the workspace,
temporary folders included, before and after).
"""

import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from parameterized import parameterized
from safetensors.torch import load_file, save_file

import surgery
import surgery.io.checkpoint as checkpoint
import surgery.io.safetensors_writer as writer
from flux2_testing import build, small_config
from surgery.testing import run_on_cpu_ranks, single_rank_group
from surgery.sight.report import local

ROOT = Path(tempfile.mkdtemp(prefix="surgery-ckpt-"))
TESTS = Path(__file__).resolve().parents[1]
# what a subprocess needs on its path: the repository, the tests' workers and their helpers
PYTHONPATH = os.pathsep.join([str(TESTS.parent), str(TESTS / "workers"), str(TESTS / "support")])
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
CONFIG, SEED = "klein9b_small", 4


def tearDownModule():
    shutil.rmtree(ROOT, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def fused_checkpoint() -> Path:
    folder = ROOT / "cache" / "fused"
    build(small_config(CONFIG), SEED).save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=None)
def unfused_checkpoint() -> Path:
    return surgery.state_dict.convert_checkpoint(fused_checkpoint(), ROOT / "cache" / "unfused")


@functools.lru_cache(maxsize=None)
def reference() -> dict[str, torch.Tensor]:
    return build(small_config(CONFIG), SEED).state_dict()


@functools.lru_cache(maxsize=None)
def few_mb_checkpoint() -> Path:
    """About 7 MB in fp32 (16 heads of 16), so a kill lands in the middle of the writes."""
    folder = ROOT / "cache" / "few-mb"
    config = dict(small_config(CONFIG), num_attention_heads=16, num_single_layers=2)
    build(config, 7).save_pretrained(folder)
    return folder


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (files), 'dir', or 'link -> target', for everything under `root`, hidden included."""
    out = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            out[name] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            out[name] = "dir"
        else:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*surgery-tmp*"))


def surgery_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    return subprocess.run([sys.executable, "-m", "surgery", *args], capture_output=True, text=True, timeout=300,
                          env=env, **kwargs)


class Workspace(unittest.TestCase):
    """Each test works in a fresh folder holding a copy of the fused checkpoint as `A`."""

    def setUp(self):
        self.ws = Path(tempfile.mkdtemp(dir=ROOT))
        self.addCleanup(shutil.rmtree, self.ws, ignore_errors=True)
        self.src = self.ws / "A"
        shutil.copytree(fused_checkpoint(), self.src)

    def assert_refused_untouched(self, pattern, call, *args, **kwargs):
        """`call` raises SurgeryError matching `pattern`, and every file under the workspace is as it was."""
        before = tree(self.ws)
        with self.assertRaisesRegex(surgery.SurgeryError, pattern):
            call(*args, **kwargs)
        self.assertEqual(tree(self.ws), before)

    def assert_state(self, folder: Path, expected: dict[str, torch.Tensor]):
        """Stock diffusers loads `folder` and holds exactly `expected`."""
        from diffusers import Flux2Transformer2DModel

        model = Flux2Transformer2DModel.from_pretrained(folder)
        state = model.state_dict()
        self.assertEqual(state.keys(), expected.keys())
        for key, value in expected.items():
            self.assertTrue(torch.equal(state[key], value), key)


class DestinationIsSource(Workspace):
    @parameterized.expand([("same",), ("trailing_slash",), ("symlink",), ("inside",), ("pipeline_transformer",),
                           ("holds_source",)])
    def test_refused_before_anything_is_written(self, case):
        src, dst = self.src, {"same": "A", "trailing_slash": "A/", "inside": "A/sub"}.get(case)
        if case == "symlink":
            (self.ws / "L").symlink_to("A")
            dst = "L"
        if case in ("pipeline_transformer", "holds_source"):
            pipe = self.ws / "PIPE"
            shutil.copytree(self.src, pipe / "transformer")
            (pipe / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline"}))
            src, dst = ("PIPE", "PIPE/transformer") if case == "pipeline_transformer" else ("PIPE/transformer", "PIPE")
        cwd = os.getcwd()
        os.chdir(self.ws)
        self.addCleanup(os.chdir, cwd)
        pattern = "holds the source" if case == "holds_source" else "is, or lies inside, the source"
        for overwrite in (False, True):
            self.assert_refused_untouched(pattern, surgery.state_dict.convert_checkpoint, src, dst, overwrite=overwrite)


class Interrupted(Workspace):
    """A conversion that fails or is killed midway leaves the previous destination as it was."""

    def setUp(self):
        super().setUp()
        self.dst = self.ws / "out"
        surgery.state_dict.convert_checkpoint(self.src, self.dst)
        (self.dst / "README.md").write_text("kept")
        self.other = self.ws / "B"
        build(small_config(CONFIG), SEED + 1).save_pretrained(self.other)

    def failing_write(self, error, after=3):
        write, calls = writer.write_chunk, [0]

        def failing(out, chunk):
            calls[0] += 1
            if calls[0] > after:
                raise error
            write(out, chunk)
        return mock.patch.object(writer, "write_chunk", failing)

    @parameterized.expand([("error", RuntimeError("boom"), "boom"),
                           ("full_disk", OSError(errno.ENOSPC, "No space left on device"),
                            r"cannot write '.*out.*': No space left on device\. '.*out' is as it was"),
                           ("interrupt", KeyboardInterrupt(), None)])
    def test_raised_inside_the_write(self, _, error, pattern):
        before = tree(self.ws)
        with self.failing_write(error), self.assertRaises(type(error) if pattern is None else Exception) as raised:
            surgery.state_dict.convert_checkpoint(self.other, self.dst, overwrite=True, max_shard_size="100KB")
        if pattern is not None:
            self.assertRegex(str(raised.exception), pattern)
        self.assertEqual(tree(self.ws), before)

    def test_read_only_folder(self):
        def refuse(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(self.ws))

        with mock.patch("surgery.io.atomic.tempfile.mkdtemp", refuse):
            self.assert_refused_untouched(r"cannot write beside '.*out': Read-only file system",
                                          surgery.state_dict.convert_checkpoint, self.other, self.dst, overwrite=True)

    def test_sigkill_midway_then_rerun(self):
        before = tree(self.dst)
        marker = self.ws / "writing"
        worker = subprocess.Popen(
            [sys.executable, str(TESTS / "workers" / "convert_worker.py"), "stall", str(few_mb_checkpoint()),
             str(self.dst), str(marker)],
            env=dict(os.environ, PYTHONPATH=PYTHONPATH),
        )
        deadline = time.monotonic() + 120
        while not marker.exists() and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(marker.exists(), "the worker never reached the write")
        partial = Path(marker.read_text())
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        self.assertEqual(worker.returncode, -signal.SIGKILL)
        self.assertEqual(tree(self.dst), before)  # the previous output, bitwise
        self.assertTrue(partial.exists() and ".surgery-tmp-" in partial.parent.name, partial)
        self.assertEqual(len(temporaries(self.ws)), 1)
        # The next run removes the dead run's temporary folder and completes.
        surgery.state_dict.convert_checkpoint(few_mb_checkpoint(), self.dst, overwrite=True)
        self.assertEqual(temporaries(self.ws), [])
        self.assertEqual((self.dst / "README.md").read_text(), "kept")
        fresh = surgery.state_dict.convert_checkpoint(few_mb_checkpoint(), self.ws / "fresh")
        self.assertEqual(tree(self.dst) | {"README.md": ""}, tree(fresh) | {"README.md": ""})

    def test_destination_is_a_file(self):
        (self.ws / "F").write_bytes(b"not a folder")
        self.assert_refused_untouched("'.*F' is a file, not a folder", surgery.state_dict.convert_checkpoint,
                                      self.src, self.ws / "F")


class OldCheckpointInDestination(Workspace):
    """A destination holding an older sharded checkpoint: refused, or replaced whole with overwrite."""

    def setUp(self):
        super().setUp()
        self.dst = self.ws / "dst"
        build(small_config(CONFIG), SEED + 1).save_pretrained(self.dst, max_shard_size="60KB")
        (self.dst / "README.md").write_text("mine")
        (self.dst / "notes").mkdir()
        (self.dst / "notes" / "a.txt").write_text("also mine")
        self.old = tree(self.dst)
        self.assertGreater(len(list(self.dst.glob("*.safetensors"))), 5)

    def test_refused_without_overwrite(self):
        self.assert_refused_untouched("already holds a checkpoint .*pass overwrite=True",
                                      surgery.state_dict.convert_checkpoint, unfused_checkpoint(), self.dst, to="fused")

    @parameterized.expand([("one_file", "10GB", True), ("sharded", "200KB", True),
                           ("two_renames", "200KB", False)])  # where renameat2 is missing: rename old away, new in
    def test_overwrite_replaces_it_whole(self, _, max_shard_size, renameat2):
        with mock.patch("surgery.io.atomic._renameat2", return_value=False) if not renameat2 else contextlib.nullcontext():
            surgery.state_dict.convert_checkpoint(unfused_checkpoint(), self.dst, to="fused", overwrite=True,
                                       max_shard_size=max_shard_size)
        written = {p.name for p in self.dst.glob("diffusion_pytorch_model*")}
        fresh = surgery.state_dict.convert_checkpoint(unfused_checkpoint(), self.ws / "fresh", to="fused",
                                           max_shard_size=max_shard_size)
        self.assertEqual(written, {p.name for p in fresh.glob("diffusion_pytorch_model*")})  # no old shard left
        self.assertEqual(sorted(os.listdir(self.dst)), sorted([*os.listdir(fresh), "README.md", "notes"]))
        self.assertEqual((self.dst / "notes" / "a.txt").read_text(), "also mine")
        self.assertEqual(temporaries(self.ws), [])
        self.assert_state(self.dst, reference())  # stock diffusers loads the NEW weights


class FilesPickedAsDiffusersDoes(Workspace):
    @classmethod
    def setUpClass(cls):
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            group = single_rank_group()
            group.__enter__()
            cls.addClassCleanup(group.__exit__, None, None, None)
        cls.mesh = init_device_mesh("cpu", (1,))

    def load(self, folder, **kwargs) -> dict[str, torch.Tensor]:
        model = surgery.load_tensor_parallel(None, folder, self.mesh, progress=False, **kwargs)
        return {name: local(p.detach()) for name, p in model.named_parameters()}

    def expected_unfused(self, dtype=torch.float32) -> dict[str, torch.Tensor]:
        model = surgery.unfuse(build(small_config(CONFIG), SEED))
        return {name: p.detach().to(dtype) for name, p in model.named_parameters()}

    def assert_same(self, got, expected):
        self.assertEqual(got.keys(), expected.keys())
        for key, value in expected.items():
            self.assertTrue(torch.equal(got[key], value), key)

    def add_ema(self):
        ema = {k: v + 1 for k, v in load_file(self.src / WEIGHTS).items()}
        save_file(ema, self.src / "diffusion_pytorch_model_ema.safetensors", metadata={"format": "pt"})

    def test_stray_ema_file_is_ignored(self):
        self.add_ema()
        self.assert_same(self.load(self.src), self.expected_unfused())
        surgery.state_dict.convert_checkpoint(self.src, self.ws / "U")
        surgery.state_dict.convert_checkpoint(self.ws / "U", self.ws / "F", to="fused")
        self.assert_state(self.ws / "F", reference())

    def test_only_a_stray_file_is_refused_by_name(self):
        self.add_ema()
        (self.src / WEIGHTS).unlink()
        pattern = r"has neither .*diffusion_pytorch_model.safetensors; it holds \['diffusion_pytorch_model_ema"
        self.assert_refused_untouched(pattern, self.load, self.src)
        self.assert_refused_untouched(pattern, surgery.state_dict.convert_checkpoint, self.src, self.ws / "U")

    def test_variant_only_when_asked(self):
        half = {k: v.half() for k, v in load_file(self.src / WEIGHTS).items()}
        save_file(half, self.src / "diffusion_pytorch_model.fp16.safetensors", metadata={"format": "pt"})
        self.assert_same(self.load(self.src), self.expected_unfused())
        self.assert_same(self.load(self.src, variant="fp16"), self.expected_unfused(torch.float16))
        surgery.state_dict.convert_checkpoint(self.src, self.ws / "U", variant="fp16", max_shard_size="100KB")
        self.assertTrue((self.ws / "U" / "diffusion_pytorch_model.safetensors.index.fp16.json").exists())
        self.assertTrue(list((self.ws / "U").glob("diffusion_pytorch_model.fp16-00001-of-*.safetensors")))
        (self.src / WEIGHTS).unlink()
        self.assert_refused_untouched(r"For a variant pass variant='fp16'", self.load, self.src)

    def test_mixed_dtypes_refused_unless_dtype_is_explicit(self):
        tensors = load_file(self.src / WEIGHTS)
        name = "transformer_blocks.0.attn.to_k.weight"
        tensors[name] = tensors[name].half()
        save_file(tensors, self.src / WEIGHTS, metadata={"format": "pt"})
        self.assert_refused_untouched(rf"'.*{WEIGHTS}': tensor '{name}' is torch.float16 while \d+ other tensors are "
                                      r"torch.float32 .*pass dtype=", self.load, self.src)
        loaded = self.load(self.src, dtype=torch.float32)  # cast, as asked
        self.assertTrue(torch.equal(loaded[name], tensors[name].float()))

    def test_integer_tensor_refused_even_with_dtype(self):
        tensors = load_file(self.src / WEIGHTS)
        name = "x_embedder.weight"
        tensors[name] = tensors[name].to(torch.int32)
        save_file(tensors, self.src / WEIGHTS, metadata={"format": "pt"})
        for dtype in (None, torch.bfloat16):
            self.assert_refused_untouched(rf"tensor '{name}' is torch.int32, the model's is floating point",
                                          self.load, self.src, dtype=dtype)
        self.assert_refused_untouched(rf"tensor '{name}' is torch.int32", surgery.state_dict.convert_checkpoint, self.src,
                                      self.ws / "U")


class CheckedBeforeWriting(Workspace):
    def test_config_mismatch(self):
        config = json.loads((self.src / "config.json").read_text())
        (self.src / "config.json").write_text(json.dumps({**config, "mlp_ratio": 2.0}))
        self.assert_refused_untouched(rf"'.*A/{WEIGHTS}': tensor 'single_transformer_blocks.0.attn.to_out.weight' has "
                                      r"shape \(64, 256\), the model needs \(64, 192\)",
                                      surgery.state_dict.convert_checkpoint, self.src, self.ws / "U")

    def test_nothing_to_convert(self):
        from diffusers import AutoencoderKL

        other = self.ws / "vae"
        AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4).save_pretrained(other)
        self.assert_refused_untouched("AutoencoderKL checkpoint, which has no fused modules .*nothing to convert",
                                      surgery.state_dict.convert_checkpoint, other, self.ws / "U")

    def test_part_with_another_dtype(self):
        unfused = self.ws / "U"
        shutil.copytree(unfused_checkpoint(), unfused)
        tensors = load_file(unfused / WEIGHTS)
        name = "single_transformer_blocks.1.attn.to_qkv_mlp_proj.k.weight"
        tensors[name] = tensors[name].half()
        save_file(tensors, unfused / WEIGHTS, metadata={"format": "pt"})
        self.assert_refused_untouched(rf"tensor '{name}' is torch.float16 while its sibling parts are torch.float32",
                                      surgery.state_dict.convert_checkpoint, unfused, self.ws / "F", to="fused")

    def test_state_dicts_refuse_extra_rows(self):
        model = build(small_config(CONFIG), SEED)
        slices = surgery.state_dict.weight_slices(model)
        fused = dict(model.state_dict())
        name = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"
        fused[name] = torch.cat([fused[name], torch.zeros(8, fused[name].shape[1])])
        snapshot = {k: v.clone() for k, v in fused.items()}
        with self.assertRaisesRegex(surgery.SurgeryError, rf"'{name}' has 584 entries along dim 0; .* cover exactly "
                                                          "576"):
            surgery.state_dict.unfuse_state_dict(fused, slices)
        unfused = surgery.state_dict.unfuse_state_dict(model.state_dict(), slices)
        part = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.v.weight"
        unfused[part] = torch.cat([unfused[part], torch.zeros(8, unfused[part].shape[1])])
        with self.assertRaisesRegex(surgery.SurgeryError, rf"'{part}' has shape \(72, 64\), the slice .* needs 64"):
            surgery.state_dict.fuse_state_dict(unfused, slices)
        self.assertTrue(all(torch.equal(fused[k], v) for k, v in snapshot.items()))


class Messages(Workspace):
    """Broken files: a SurgeryError naming the file, from the loader's reader and from convert."""

    def sharded(self) -> Path:
        folder = self.ws / "S"
        build(small_config(CONFIG), SEED).save_pretrained(folder, max_shard_size="100KB")
        return folder

    def assert_named(self, folder, pattern):
        self.assert_refused_untouched(pattern, lambda: checkpoint.Reader(folder).__exit__())
        self.assert_refused_untouched(pattern, surgery.state_dict.convert_checkpoint, folder, self.ws / "out")

    def test_truncated_file(self):
        data = (self.src / WEIGHTS).read_bytes()
        (self.src / WEIGHTS).write_bytes(data[: len(data) // 2])
        self.assert_named(self.src, rf"'.*A/{WEIGHTS}' is not a readable safetensors file .*truncated")

    def test_malformed_index(self):
        folder = self.sharded()
        (folder / INDEX).write_text('{"metadata": {}, "weight_map": {')
        self.assert_named(folder, rf"'.*{INDEX}' is not a valid checkpoint index \(JSONDecodeError")
        (folder / INDEX).write_text('{"metadata": {}}')
        self.assert_named(folder, rf"'.*{INDEX}' is not a valid checkpoint index \(KeyError")

    def test_key_absent_from_its_shard(self):
        folder = self.sharded()
        index = json.loads((folder / INDEX).read_text())
        name, shard = "proj_out.weight", index["weight_map"]["proj_out.weight"]
        other = next(f for f in sorted(set(index["weight_map"].values())) if f != shard)
        index["weight_map"][name] = other
        (folder / INDEX).write_text(json.dumps(index))
        self.assert_named(folder, rf"'.*{other}' lacks 1 tensor\(s\) that '{INDEX}' places there, first '{name}'")

    def test_shard_missing(self):
        folder = self.sharded()
        shard = sorted(folder.glob("*-00002-of-*.safetensors"))[0]
        shard.unlink()
        self.assert_named(folder, rf"names shard '.*{shard.name}', which does not exist")


class CommandLine(Workspace):
    """`surgery convert` user errors: one line on stderr, a non-zero exit, never a traceback."""

    def assert_one_line(self, code, stderr, pattern):
        self.assertNotEqual(code, 0)
        self.assertNotIn("Traceback", stderr)
        self.assertEqual(len(stderr.strip().splitlines()), 1, stderr)
        self.assertRegex(stderr, pattern)

    def test_user_errors(self):
        """In this process (an exception other than SystemExit would fail the test with its traceback)."""
        from surgery.app.cli import main

        (self.ws / "B").mkdir()
        (self.ws / "B" / "config.json").write_text("{}")
        (self.ws / "F").write_text("a file")
        truncated = self.ws / "T"
        shutil.copytree(self.src, truncated)
        (truncated / WEIGHTS).write_bytes((self.src / WEIGHTS).read_bytes()[:1000])
        cases = [
            (["A", "A"], "is, or lies inside, the source"),
            (["A", "B"], r"'B' already holds a checkpoint \(config.json\): pass overwrite=True \(--overwrite\)"),
            (["A", "F"], "'F' is a file, not a folder"),
            (["T", "x"], "is not a readable safetensors file"),
            (["A", "x", "--max-shard-size", "ten"], "max_shard_size 'ten'"),
            (["A", "x", "--variant", "fp16"], "has neither .*fp16"),
            (["org/absent", "x"], "does not exist locally and is not in the local Hugging Face cache"),
        ]
        cwd = os.getcwd()
        os.chdir(self.ws)
        self.addCleanup(os.chdir, cwd)
        before = tree(self.ws)
        for args, pattern in cases:
            with self.subTest(args=args):
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
                    main(["convert", *args])
                self.assert_one_line(exit_.exception.code, stderr.getvalue(), pattern)
        self.assertEqual(tree(self.ws), before)

    def test_in_a_subprocess(self):
        """The real command: a path with one '/' that does not exist (not a Hub id), then a real write error midway
        (RLIMIT_FSIZE gives EFBIG, as a full disk gives ENOSPC): one line each, nothing left behind."""
        def limit():
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

        before = tree(self.ws)
        result = surgery_cli("convert", "/nonexistent", "x", cwd=self.ws)
        self.assert_one_line(result.returncode, result.stderr, r"'/nonexistent' does not exist")
        result = surgery_cli("convert", "A", "out", cwd=self.ws, preexec_fn=limit)
        self.assert_one_line(result.returncode, result.stderr, r"cannot write '.*': File too large\. '.*out' is as it")
        self.assertEqual(tree(self.ws), before)


class ShardedConversion(Workspace):
    """diffusers' sharded layout: names, index, bitwise round trip, stock from_pretrained."""

    def test_round_trip_through_shards(self):
        source, unfused, fused = self.ws / "S", self.ws / "U", self.ws / "F"
        build(small_config(CONFIG), SEED).save_pretrained(source, max_shard_size="120KB")  # sharded by diffusers
        surgery.state_dict.convert_checkpoint(source, unfused, max_shard_size="100KB")
        surgery.state_dict.convert_checkpoint(unfused, fused, to="fused", max_shard_size="150KB")
        for folder in (source, unfused, fused):
            index = json.loads((folder / INDEX).read_text())
            shards = sorted(p.name for p in folder.glob("*.safetensors"))
            count = len(shards)
            self.assertGreater(count, 2)
            self.assertEqual(shards, [f"diffusion_pytorch_model-{i:05d}-of-{count:05d}.safetensors"
                                      for i in range(1, count + 1)])
            self.assertEqual(sorted(set(index["weight_map"].values())), shards)
            tensors = {}
            for shard in shards:
                tensors.update(load_file(folder / shard))
            self.assertEqual(index["metadata"]["total_size"], sum(t.nbytes for t in tensors.values()))
            self.assertEqual(set(index["weight_map"]), set(tensors))
        model = surgery.unfuse(build(small_config(CONFIG), SEED))
        unfused_tensors = {}
        for shard in unfused.glob("*.safetensors"):
            unfused_tensors.update(load_file(shard))
        self.assertEqual(unfused_tensors.keys(), dict(model.named_parameters()).keys())
        self.assert_state(fused, reference())  # bitwise, through stock from_pretrained

    def test_peak_memory_is_about_one_tensor(self):
        """A checkpoint of some hundreds of MB (klein-4B-shaped, reduced depth) converted into 50 MB shards."""
        from surgery_rewrites.flux2 import seeded_model
        from surgery.app.demo import demo_config

        big = ROOT / "cache" / "klein4b-demo"
        if not big.exists():
            seeded_model(demo_config("flux2-klein-4b"), 0).save_pretrained(big)
        largest = max(t.nbytes for t in load_file(big / WEIGHTS).values())
        size = (big / WEIGHTS).stat().st_size
        result = run_on_cpu_ranks(__import__("convert_worker").convert_peak, 1, str(big),
                                          str(self.ws / "U"), str(self.src), str(self.ws / "warm"))[0]
        print(f"\nconvert {size / 2**20:.0f} MB into 50 MB shards: peak {result['peak'] / 2**20:.1f} MB owned "
              f"(largest tensor {largest / 2**20:.1f} MB; {result['mapped_peak'] / 2**20:.0f} MB with mapped file "
              f"pages), {result['seconds']:.2f} s")
        self.assertGreater(len(list((self.ws / "U").glob("*.safetensors"))), 3)
        self.assertLess(result["peak"], largest + 16 * 2**20)
