"""The lock beside a destination (`.<name>.surgery-lock`) is surgery's own plain file: a link or a second name
planted there is refused before anything is written, and the file it leads to stays as it was (before: `save_pretrained`
and `convert` truncated and overwrote the file a planted link pointed to)."""

import os
import shutil
import tempfile
import unittest
from pathlib import Path

import surgery
from flux2_testing import build, small_config

CONFIG = small_config("tp_wide")


class PlantedLock(unittest.TestCase):
    def setUp(self):
        self.root = Path(tempfile.mkdtemp(prefix="surgery-lock-"))
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.users = self.root / "notes.txt"
        self.users.write_text("a user's file")
        self.dst = self.root / "model"
        self.lock = self.root / ".model.surgery-lock"

    def save(self):
        surgery.save_pretrained(surgery.unfuse(build(CONFIG)), self.dst)

    def convert(self):
        src = self.root / "fused"
        build(CONFIG).save_pretrained(src)
        surgery.state_dict.convert_checkpoint(src, self.dst)

    def assert_refused(self, write, pattern):
        with self.assertRaisesRegex(surgery.SurgeryError, pattern):
            write()
        self.assertEqual(self.users.read_text(), "a user's file")
        self.assertFalse(self.dst.exists())

    def test_a_link_is_never_followed(self):
        os.symlink(self.users, self.lock)
        for write in (self.save, self.convert):
            with self.subTest(write.__name__):
                self.assert_refused(write, rf"'{self.lock}' is not surgery's lock file but a link to '{self.users}'; "
                                           "surgery locks only a plain file of its own there. Remove it")
                self.assertTrue(self.lock.is_symlink())

    def test_a_second_name_of_a_users_file_is_not_truncated(self):
        os.link(self.users, self.lock)
        self.assert_refused(self.save, r"is not surgery's lock file but a file with other names \(hard links\)")

    def test_a_stale_lock_file_of_its_own_is_taken(self):
        self.lock.write_text("process 1 on a host that crashed")
        self.save()
        self.assertTrue((self.dst / "config.json").exists())
        self.assertFalse(self.lock.exists())
