"""What the rows of rewrites/derived_more_image.py needed from the engine (their sharded proof is the conformance
suite's, by registration)."""

from __future__ import annotations

import unittest

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor2_0, AuraFlowAttnProcessor2_0

import surgery
from surgery.core.registry import families, registered


class SharedAttentionRewrites(unittest.TestCase):
    def test_families_setting_different_shared_processors_on_attention_each_get_their_rewrite(self):
        # SD3's family and AuraFlow's both list `Attention` with processors of diffusers' attention_processor.py;
        # named by that file alone, the second rewrite would clash with the first at registration
        def swapping(processor):
            return [r for r in registered() if r.fused is Attention
                    and r.is_fused(Attention(query_dim=8, heads=2, dim_head=4, processor=processor()))]

        aura, generic = swapping(AuraFlowAttnProcessor2_0), swapping(AttnProcessor2_0)
        self.assertEqual(len(aura), 1)
        self.assertEqual(len(generic), 1)
        self.assertNotEqual(aura[0].name, generic[0].name)
        self.assertIs(families()["auraflow"].rewrites[0], aura[0])


class AllReducesOfModulesCalledTwice(unittest.TestCase):
    def test_glm_image_counts_its_feed_forward_once_per_stream(self):
        # each GLM-Image block runs its one FeedForward on the image and on the text tokens, and the glyph and prior
        # projectors are FeedForwards too: 3 rowwise outputs per block + 2, read off the forward on meta (its
        # dropped-prior-token mask is a boolean index)
        family = families()["glm-image"]
        config = dict(family.test_configs["tiny"])
        self.assertEqual(family.count_all_reduces(config), 3 * config["num_layers"] + 2)
        self.assertEqual(family.count_all_reduces(family.config()), 3 * 30 + 2)


if __name__ == "__main__":
    unittest.main()
