"""Drift: every edit `surgery.core.leaves` makes to a diffusers method still finds its text in the installed diffusers.

No diffusers forward or processor is copied into this repository: the twins are the installed stock source with the
processor rule's edits or those listed in `surgery.core.leaves.EDITS` (`surgery.core.leaves.edits_for`). When a diffusers release changes an original, its edit no longer
fits and this test names it, instead of a frozen copy silently diverging.
"""

import importlib
import inspect
import textwrap
import unittest

import surgery
from surgery.core import leaves
from surgery.core.errors import SurgeryError


def _owner(key: str):
    module, cls, method = key.rsplit(".", 2)
    return getattr(importlib.import_module(module), cls), method


class Drift(unittest.TestCase):
    def test_every_edit_fits_the_installed_source_exactly(self):
        surgery.core.registry.registered()  # builds every family's twins
        keys = {**leaves.EDITS, **{f"{leaves.qualified(stock)}.{method}": None
                                   for stock, twin in leaves._twins.items() for method in leaves.twin_methods(twin)}}
        for key in keys:
            stock, method = _owner(key)
            edits = leaves.edits_for(stock, method)
            source = textwrap.dedent(inspect.getsource(getattr(stock, method)))
            for old, new, count in edits:
                self.assertEqual(source.count(old), count, f"{key}: {old!r}")
            edited = leaves.edited_source(stock, method)
            # the twin differs from the stock source in the listed edits only
            undone = edited
            for old, new, _ in edits:
                undone = undone.replace(new, old)
            self.assertEqual(undone, source, key)
            self.assertNotEqual(edited, source, key)

    def test_every_twin_in_use_is_built_from_the_rule_or_a_listed_edit(self):
        surgery.core.registry.registered()
        for stock, twin in leaves._twins.items():
            for method in leaves.twin_methods(twin):
                self.assertIsNotNone(leaves.edits_for(stock, method), leaves.qualified(stock))
            self.assertTrue(issubclass(twin, stock))

    def test_the_rule_reads_every_use_of_the_head_count(self):
        # a processor that reads attn.heads besides (attn.heads, -1): the rule does not apply, and no twin is built
        from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0
        from diffusers.models.transformers.transformer_flux3 import Flux3AttnProcessor

        self.assertIsNone(leaves.rule_edits(IPAdapterAttnProcessor2_0))  # its image-prompt views read attn.heads
        self.assertEqual(leaves.rule_edits(Flux3AttnProcessor), ((leaves.HEADS_BY_COUNT, leaves.HEAD_DIM, 3),))

        class Odd(Flux3AttnProcessor):
            def __call__(self, attn, hidden_states):
                return hidden_states.unflatten(-1, (attn.heads, -1)).mean(-2) * attn.heads

        self.assertIsNone(leaves.rule_edits(Odd))
        with self.assertRaisesRegex(SurgeryError, "Odd.__call__ reshapes by no"):
            leaves.edited_source(Odd)

    def test_the_rule_reads_the_head_count_last_but_one_in_a_longer_view(self):
        # WanAnimate's face adapter views k/v as `(B, T, N, attn.heads, -1)`, q as `unflatten(2, (attn.heads, -1))`:
        # counted from diffusers' source here, independently of the rule
        from diffusers.models.transformers.transformer_wan_animate import WanAnimateFaceBlockAttnProcessor

        source = inspect.getsource(WanAnimateFaceBlockAttnProcessor.__call__)
        self.assertEqual(source.count("view(B, T, N, attn.heads, -1)"), 2)
        self.assertEqual(leaves.rule_edits(WanAnimateFaceBlockAttnProcessor), (
            (leaves.HEADS_BY_COUNT, leaves.HEAD_DIM, 1), (leaves.VIEW_HEADS_LAST, leaves.VIEW_HEAD_DIM_LAST, 2)))
        edited = leaves.edited_source(WanAnimateFaceBlockAttnProcessor)
        self.assertEqual(edited.count("view(B, T, N, -1, getattr(attn, 'head_dim', None) or (attn.inner_dim if "
                                      "hasattr(attn, 'inner_dim') else attn.to_q.out_features) // attn.heads)"), 2)

    def test_the_head_size_falls_back_to_the_query_width_where_the_module_keeps_neither(self):
        # WanAnimate2's attention keeps no `head_dim` and no `inner_dim`: its processors' three
        # `unflatten(2, (attn.heads, -1))` read the head size off `to_q` (counted from diffusers' source here)
        from diffusers.models.transformers.transformer_wan_animate_2 import (WanAnimate2Attention,
                                                                              WanAnimate2AttnProcessor)

        attn = WanAnimate2Attention(dim=64, heads=4)
        self.assertFalse(hasattr(attn, "head_dim") or hasattr(attn, "inner_dim"))
        source = inspect.getsource(WanAnimate2AttnProcessor.__call__)
        self.assertEqual(source.count("unflatten(2, (attn.heads, -1))"), 3)
        edited = leaves.edited_source(WanAnimate2AttnProcessor)
        self.assertNotIn("attn.heads, -1", edited)
        self.assertEqual(edited.count("unflatten(2, (-1, getattr(attn, 'head_dim', None) or (attn.inner_dim if "
                                      "hasattr(attn, 'inner_dim') else attn.to_q.out_features) // attn.heads))"), 3)
        self.assertEqual(eval(leaves.HEAD_SIZE, {}, {"attn": attn}), 16)

    def test_the_rule_reads_the_older_spelling_by_the_key_width(self):
        # SD3's joint processor: head_dim from the local key width over the stored count, views by the count. Read
        # as the head size from the global widths and views by the heads the local width holds; counted from
        # diffusers' source here, independently of the rule
        from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, JointAttnProcessor2_0

        source = inspect.getsource(JointAttnProcessor2_0.__call__)
        views = source.count("batch_size, -1, attn.heads, head_dim")
        self.assertEqual(views, 6)  # q, k, v and the three added projections
        self.assertEqual(leaves.rule_edits(JointAttnProcessor2_0), (
            (leaves.HEAD_DIM_BY_COUNT.format(width="inner_dim"), leaves.HEAD_DIM_GLOBAL, 1),
            (leaves.VIEW_BY_COUNT, leaves.VIEW_BY_WIDTH.format(width="inner_dim"), views),
            (leaves.MERGE_BY_COUNT, leaves.MERGE_BY_WIDTH.format(width="inner_dim"), 1)))
        edited = leaves.edited_source(JointAttnProcessor2_0)
        self.assertNotIn("attn.heads, head_dim", edited)
        self.assertNotIn("attn.heads * head_dim", edited)
        # a mask prepared per head (CogVideoX's processor) is kept once
        self.assertEqual(leaves.rule_edits(CogVideoXAttnProcessor2_0)[-1],
                         (leaves.MASK_BY_COUNT, leaves.MASK_ONCE, 1))

        class Odd(JointAttnProcessor2_0):  # the older spelling, but the count read once more
            def __call__(self, attn, hidden_states):
                key = attn.to_k(hidden_states)
                inner_dim = key.shape[-1]
                head_dim = inner_dim // attn.heads
                return key.view(1, -1, attn.heads, head_dim).sum(2) / attn.heads

        self.assertIsNone(leaves.rule_edits(Odd))

    def test_a_changed_original_is_refused_by_name(self):
        key = next(iter(leaves.EDITS))
        stock, method = _owner(key)
        saved = leaves.EDITS[key]
        leaves.EDITS[key] = ((saved[0][0], saved[0][1], saved[0][2] + 1),)  # what a changed original looks like
        try:
            with self.assertRaisesRegex(SurgeryError, "installed diffusers changed it"):
                leaves.edited_source(stock, method)
        finally:
            leaves.EDITS[key] = saved
