"""One atomic swap for every checkpoint writer (issues 17 and 18): `surgery.save_pretrained` owns only what it
writes, the destination is never absent nor half-written, one writer at a time, pipeline roots and `.` handled."""

import hashlib
import os
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

import surgery
from surgery.io import atomic, safetensors_writer, saving
from surgery.core.state_dict import checkpoint_slices
from flux2_testing import build, small_config

TESTS = Path(__file__).resolve().parents[1]
# what a subprocess needs on its path: the repository, the tests' workers and their helpers
PYTHONPATH = os.pathsep.join([str(TESTS.parent), str(TESTS / "workers"), str(TESTS / "support")])
CONFIG = "klein4b_small"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def tree(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        out[name] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def state(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_pretrained(folder).state_dict()


class Case(unittest.TestCase):
    def setUp(self):
        self.root = Path(tempfile.mkdtemp(prefix="surgery-atomic-"))
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.fused = build(small_config(CONFIG), 0)
        self.model = surgery.unfuse(build(small_config(CONFIG), 1))
        self.dst = self.root / "model"

    def mine(self, folder: Path) -> None:
        """Files a user keeps beside a checkpoint, which no save owns."""
        (folder / "README.md").write_text("mine")
        (folder / "pytorch_lora_weights.safetensors").write_bytes(b"a LoRA")
        (folder / "samples").mkdir()
        (folder / "samples" / "0.png").write_bytes(b"an image")

    def assert_new_checkpoint(self, folder: Path, kept: bool = True):
        expected = surgery.fuse(build(small_config(CONFIG), 1)).state_dict()
        got = state(folder)
        self.assertEqual(got.keys(), expected.keys())
        self.assertTrue(all(torch.equal(got[k], v) for k, v in expected.items()))
        if kept:
            self.assertEqual((folder / "README.md").read_text(), "mine")
            self.assertEqual((folder / "samples" / "0.png").read_bytes(), b"an image")
            self.assertEqual((folder / "pytorch_lora_weights.safetensors").read_bytes(), b"a LoRA")
        self.assertEqual(sorted(p.name for p in folder.parent.iterdir() if ".surgery-" in p.name), [])


class OwnsOnlyWhatItWrites(Case):
    def test_files_beside_the_checkpoint_are_kept_and_old_shards_replaced(self):
        self.fused.save_pretrained(self.dst, max_shard_size="30KB")
        self.mine(self.dst)
        self.assertGreater(len(list(self.dst.glob("*.safetensors"))), 4)
        surgery.save_pretrained(self.model, self.dst)
        self.assert_new_checkpoint(self.dst)
        self.assertEqual(sorted(p.name for p in self.dst.glob("diffusion_pytorch_model*")), [WEIGHTS])

    def test_a_pipeline_root_is_refused_and_left_as_it_was(self):
        pipe = self.root / "pipe"
        (pipe / "vae").mkdir(parents=True)
        (pipe / "vae" / "config.json").write_text("{}")
        (pipe / "model_index.json").write_text('{"_class_name": "Flux2Pipeline"}')
        self.fused.save_pretrained(self.root / "src")
        before = tree(self.root)
        with self.assertRaisesRegex(surgery.SurgeryError, r"is a pipeline folder \(it holds model_index.json\).* e.g. "
                                                          r"'.*pipe/transformer'"):
            surgery.save_pretrained(self.model, pipe)
        for overwrite in (False, True):  # convert: the same check
            with self.assertRaisesRegex(surgery.SurgeryError, "surgery.convert: '.*pipe' is a pipeline folder"):
                surgery.state_dict.convert_checkpoint(self.root / "src", pipe, overwrite=overwrite)
        self.assertEqual(tree(self.root), before)

    def test_dot_is_the_working_folder(self):
        self.dst.mkdir()
        self.mine(self.dst)
        cwd = os.getcwd()
        self.addCleanup(os.chdir, cwd)
        os.chdir(self.dst)
        self.assertEqual(surgery.save_pretrained(self.model, "."), self.dst.resolve())
        self.assertEqual(Path.cwd(), self.dst.resolve())  # this process follows its folder into the new one
        self.assertTrue(Path(WEIGHTS).is_file())
        self.assert_new_checkpoint(self.dst)

    def test_interrupted_save_leaves_the_folder_as_it_was(self):
        self.fused.save_pretrained(self.dst)
        self.mine(self.dst)
        before = tree(self.root)
        with mock.patch.object(safetensors_writer, "write_file", side_effect=KeyboardInterrupt), \
                self.assertRaises(KeyboardInterrupt):
            surgery.save_pretrained(self.model, self.dst)
        self.assertEqual(tree(self.root), before)  # no temporary folder, no lock file either

    def test_killed_save_leaves_the_folder_as_it_was_and_the_next_cleans_up(self):
        self.fused.save_pretrained(self.dst)
        self.mine(self.dst)
        before = tree(self.dst)
        marker = self.root / "writing"
        worker = subprocess.Popen(
            [sys.executable, "-c", STALLING_SAVE, str(self.dst), str(marker)],
            env=dict(os.environ, PYTHONPATH=PYTHONPATH),
        )
        deadline = time.monotonic() + 120
        while not marker.exists() and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(marker.exists(), "the worker never reached the write")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        self.assertEqual(tree(self.dst), before)
        left = sorted(p.name for p in self.root.iterdir() if ".surgery-" in p.name)
        self.assertEqual(len([n for n in left if ".surgery-tmp-" in n]), 1, left)
        surgery.save_pretrained(self.model, self.dst)  # the dead writer's lock is free and its folder removed
        self.assert_new_checkpoint(self.dst)


# A save that stops for good in the middle of writing its weights (then the test kills it).
STALLING_SAVE = """
import sys, time
from pathlib import Path
from unittest import mock
import surgery
from surgery.io import safetensors_writer
from flux2_testing import build, small_config
dst, marker = sys.argv[1:]
real = safetensors_writer.write_file
def stall(path, *args):
    real(path, *args)
    Path(marker).write_text(str(path))
    time.sleep(600)
with mock.patch.object(safetensors_writer, "write_file", stall):
    surgery.save_pretrained(surgery.unfuse(build(small_config("klein4b_small"), 1)), dst)
"""


class OneWriter(Case):
    def test_a_second_writer_is_refused_while_the_first_writes(self):
        self.fused.save_pretrained(self.dst)
        self.fused.save_pretrained(self.root / "src")
        first = atomic.Staged(self.dst.resolve(), lambda name: False, "test")
        self.assertRegex(first.path.name, rf"^\.model\.surgery-tmp-{os.getpid()}@.+-\w+$")  # unique, not fixed
        try:
            before = tree(self.root)
            with self.assertRaisesRegex(surgery.SurgeryError, rf"'.*model' is being written by process {os.getpid()} "
                                                              r"on .* right now .*Nothing was written"):
                surgery.save_pretrained(self.model, self.dst)
            with self.assertRaisesRegex(surgery.SurgeryError, "is being written by"):
                surgery.state_dict.convert_checkpoint(self.root / "src", self.dst, overwrite=True)
            self.assertEqual(tree(self.root), before)
        finally:
            first.discard()
        surgery.save_pretrained(self.model, self.dst)  # the lock went with the first writer
        self.assert_new_checkpoint(self.dst, kept=False)


class NeverAbsent(Case):
    """The swap itself: at every file-system call it makes, the destination holds a whole checkpoint (the old or the
    new one). Deleting the old folder and then renaming the new one in would leave a moment without any."""

    def test_the_destination_is_whole_at_every_step_of_the_swap(self):
        self.fused.save_pretrained(self.dst)
        self.mine(self.dst)
        staged = atomic.Staged(self.dst, safetensors_writer.owns, "test")
        surgery.save_pretrained  # noqa: B018 - the writer under test is the one both verbs use
        entries = saving._entries(saving._ModelTensors(self.model.state_dict()), checkpoint_slices(self.model))
        safetensors_writer.write_checkpoint(staged.path, entries, "10GB")
        self.model.save_config(staged.path)
        seen: list[str] = []

        def whole(where: str) -> None:
            files = {p.name for p in self.dst.iterdir()} if self.dst.is_dir() else set()
            if not {"config.json", WEIGHTS, "README.md"} <= files:
                seen.append(f"{where}: {sorted(files)}")

        def watched(fn, name):
            def call(*args, **kwargs):
                whole(f"before {name}{args[:2]}")
                try:
                    return fn(*args, **kwargs)
                finally:
                    whole(f"after {name}{args[:2]}")
            return call

        patches = [mock.patch.object(os, name, watched(getattr(os, name), f"os.{name}"))
                   for name in ("rename", "replace", "unlink", "remove", "rmdir")]
        patches += [mock.patch.object(shutil, "rmtree", watched(shutil.rmtree, "shutil.rmtree")),
                    mock.patch.object(atomic, "_renameat2", watched(atomic._renameat2, "renameat2"))]
        for patch in patches:
            patch.start()
        try:
            staged.commit()
        finally:
            for patch in reversed(patches):
                patch.stop()
        self.assertEqual(seen, [])
        self.assert_new_checkpoint(self.dst)


if __name__ == "__main__":
    unittest.main()
