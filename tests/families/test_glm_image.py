"""What GLM-Image needed from the engine (its sharded proof is the conformance suite's, by registration)."""

from __future__ import annotations

import unittest

import surgery  # noqa: F401  (registers the built-in families)
from surgery.core.registry import families


class AllReducesOfModulesCalledTwice(unittest.TestCase):
    def test_glm_image_counts_its_feed_forward_once_per_stream(self):
        # each GLM-Image block runs its one FeedForward on the image and on the text tokens, and the glyph and prior
        # projectors are FeedForwards too: 3 rowwise outputs per block + 2, read off the forward on meta (its
        # dropped-prior-token mask is a boolean index)
        family = families()["glm-image"]
        config = dict(family.tests.configs["tiny"])
        self.assertEqual(family.tp.all_reduces(config), 3 * config["num_layers"] + 2)
        self.assertEqual(family.tp.all_reduces(family.config()), 3 * 30 + 2)


if __name__ == "__main__":
    unittest.main()
