"""The folder an atomic save swaps into place has the mode a plain `mkdir` (and stock `save_pretrained`) gives a new
folder under the process's umask, and keeps the mode of the folder it replaces: the temporary sibling it is written
in starts as `mkdtemp`'s private 0o700 (issue 41: removing the `chmod` in surgery/io/atomic.py failed no test)."""

import os
import stat
import tempfile
import unittest
from pathlib import Path

import surgery
from flux2_testing import build, small_config


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class SavedFolderMode(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.fused = build(small_config("klein4b_small"), 0)
        cls.model = surgery.unfuse(build(small_config("klein4b_small"), 0))

    def setUp(self):
        self.root = Path(tempfile.mkdtemp(prefix="surgery-mode-"))
        old = os.umask(0o027)
        self.addCleanup(os.umask, old)

    def test_a_new_folder_gets_what_mkdir_and_stock_save_give(self):
        (self.root / "plain").mkdir()
        self.fused.save_pretrained(self.root / "stock")
        surgery.save_pretrained(self.model, self.root / "ours")
        self.assertEqual(mode(self.root / "plain"), 0o750)
        self.assertEqual(mode(self.root / "stock"), 0o750)
        self.assertEqual(mode(self.root / "ours"), 0o750)

    def test_a_replaced_folder_keeps_its_mode(self):
        target = self.root / "ours"
        target.mkdir()
        os.chmod(target, 0o751)
        surgery.save_pretrained(self.model, target)
        self.assertEqual(mode(target), 0o751)
        surgery.save_pretrained(self.model, target)  # a second replace, from a folder the first save made
        self.assertEqual(mode(target), 0o751)


if __name__ == "__main__":
    unittest.main()
