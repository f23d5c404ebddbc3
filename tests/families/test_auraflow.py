"""AuraFlow's rewrite of diffusers' shared `Attention` class beside the other derived families' (its sharded proof
is the conformance suite's, by registration)."""

from __future__ import annotations

import unittest

from diffusers.models.attention_processor import Attention, AttnProcessor2_0, AuraFlowAttnProcessor2_0

import surgery  # noqa: F401  (registers the built-in families)
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


if __name__ == "__main__":
    unittest.main()
