"""QwenImage-2.1: what the conformance suite cannot know (its plan against diffusers' `_tp_plan`:
tests/families/test_qwenimage.py, with QwenImage's)."""

from __future__ import annotations

import unittest

import surgery


class QwenImage21(unittest.TestCase):
    def test_qwen_image_2_1_refuses_a_meta_forward_with_the_reason(self):
        family = surgery.extend.families()["qwen-image-2.1"]
        with self.assertRaisesRegex(surgery.SurgeryError, "meta device"):
            family.example_inputs(family.config(), device="meta")


if __name__ == "__main__":
    unittest.main()
