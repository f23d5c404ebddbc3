"""The README stays short and true: its test command is CI's, its links exist, its API is the real one. Its families
table is generated with the proof (tests/app/test_families_proof.py checks it against the registry and the proof).
"""

from __future__ import annotations

import re
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEST_COMMAND = "python -m pytest -q tests -n 2 --dist loadfile"


class Readme(unittest.TestCase):
    def setUp(self):
        self.text = README.read_text()
        self.lines = self.text.splitlines()

    def test_short_with_code_early(self):
        self.assertLessEqual(len(self.lines), 150)
        first_code = next(i + 1 for i, line in enumerate(self.lines) if line.startswith("```"))
        self.assertLessEqual(first_code, 20)

    def test_ci_runs_the_set_up_commands_as_written(self):
        # the README's two set-up lines (main job, tests), without their comments, are lines of .ci/run in that order
        block = self.text.split("## Set up", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
        commands = [line.split("  #", 1)[0].strip() for line in block.strip().splitlines()]
        self.assertEqual(len(commands), 2, commands)
        self.assertTrue(commands[0].endswith("surgery demo"), commands[0])
        self.assertTrue(commands[1].endswith(TEST_COMMAND), commands[1])
        ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
        self.assertIn(commands[0], ci)
        self.assertIn(commands[1], ci)
        self.assertLess(ci.index(commands[0]), ci.index(commands[1]))

    def test_links_resolve(self):
        for target in re.findall(r"\]\(([^)#]+)\)", self.text):
            if not target.startswith("http"):
                self.assertTrue((ROOT / target).exists(), target)
        for page in (ROOT / "docs").glob("*.md"):
            for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
                if not target.startswith("http"):
                    self.assertTrue((page.parent / target).exists(), f"{page.name}: {target}")

    def test_public_api_named_in_the_readme_is_the_real_one(self):
        import surgery

        for name in surgery.__all__:
            self.assertIn(f"surgery.{name}", self.text)
        for name in re.findall(r"surgery\.(\w+)\(", self.text):
            self.assertIn(name, surgery.__all__)


if __name__ == "__main__":
    unittest.main()
