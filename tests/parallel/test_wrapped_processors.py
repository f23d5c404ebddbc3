"""A user's attention processor that wraps or subclasses a stock one (`set_attn_processor`) runs the stock code,
which reshapes by the stored head count: the derivation reads the code that runs (every `__call__` of the class's
MRO, and the processors it holds), so such a processor is refused by name before anything changes (before: Sana and
Lumina2 sharded, Sana 0.195 off and Lumina2 dying in forward; Wan, HiDream and LTX-2 refused blaming their RMSNorm).
A wrapper set after `surgery.unfuse`, around the processor unfuse installs, runs the head-dim twin and shards."""

import re
import unittest

from parameterized import parameterized
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.core.build import seeded_model
from surgery.core.registry import families
from surgery.parallel.distributed import fake_process_group
from surgery.testing import assert_unchanged, snapshot

FAMILIES = ["sana", "lumina2", "wan", "hidream", "ltx-2"]


class Wrapper:
    """What a user writes to log or tweak attention: the stock processor, called as it is."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, attn, *args, **kwargs):
        return self.inner(attn, *args, **kwargs)


def derived(processor):
    """`processor` as an instance of a user's subclass of its class that calls `super().__call__`."""
    cls = type(processor)
    sub = type(f"My{cls.__name__}", (cls,), {"__call__": lambda self, *a, **k: super(sub, self).__call__(*a, **k)})
    out = sub.__new__(sub)
    out.__dict__.update(processor.__dict__)
    return out


def tiny(name):
    family = families()[name]
    return seeded_model(family, dict(next(iter(family.tests.configs.values()))))


def set_processors(model, make):
    stock = {}
    for module in model.modules():
        if getattr(module, "processor", None) is not None:
            stock[type(module.processor).__name__] = True
            module.processor = make(module.processor)
    return sorted(stock)


def shard(model):
    with fake_process_group(2):
        surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)


class WrappedOrDerivedProcessors(unittest.TestCase):
    @parameterized.expand([(n,) for n in FAMILIES])
    def test_refused_by_name_before_anything_changes(self, name):
        for make, says in ((Wrapper, r"its processor Wrapper runs (\w+) \(its `inner`\)"),
                           (derived, r"its processor My(\w+) derives from (\w+)")):
            with self.subTest(make.__name__):
                model = tiny(name)
                stock = set_processors(model, make)
                surgery.unfuse(model)
                snap = snapshot(model)
                with self.assertRaisesRegex(surgery.SurgeryError, says + r", which reads the stored head count "
                                            r"`attn.heads`.*Set the stock processor back before sharding") as caught:
                    shard(model)
                self.assertIn(re.search(says, str(caught.exception)).groups()[-1], stock)  # the stock class
                assert_unchanged(model, snap)

    @parameterized.expand([(n,) for n in FAMILIES])
    def test_a_wrapper_around_the_processor_unfuse_installs_shards(self, name):
        model = surgery.unfuse(tiny(name))
        set_processors(model, Wrapper)
        shard(model)
