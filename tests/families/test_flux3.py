"""FLUX.3: what the conformance suite cannot know. One joint single block at the published width (24 heads of 128,
dim 3072, SwiGLU hidden 9216), bf16, sharded over 2 gloo ranks against the single-device fused block; and the leaves
and twins keep diffusers' classes, so its regional compile and block registries find every block."""

from __future__ import annotations

import copy
import unittest

import torch
from diffusers.models.transformers.transformer_flux3 import Flux3AttnProcessor, Flux3SingleTransformerBlock
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery
from surgery.core.leaves import head_dim_twin
from surgery.core.registry import families
from surgery.core.split_projection import SplitRows
from surgery.testing import CollectiveCounter, rel_err, run_on_cpu_ranks

PUBLISHED = families()["flux3"].config()
DIM = PUBLISHED["num_attention_heads"] * PUBLISHED["attention_head_dim"]


def block_inputs(seed: int, tokens: int = 24, text: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    head_dim = PUBLISHED["attention_head_dim"]
    angles = torch.rand(tokens + text, head_dim // 2, generator=g) * 6.28
    rope = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    return dict(
        hidden_states=torch.randn(1, tokens, DIM, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(1, text, DIM, generator=g).bfloat16(),
        temb_mod=(torch.randn(1, tokens, 3 * DIM, generator=g) * 0.1).bfloat16(),
        temb_mod_context=(torch.randn(1, text, 3 * DIM, generator=g) * 0.1).bfloat16(),
        image_rotary_emb=rope,
    )


def published_block(seed: int) -> Flux3SingleTransformerBlock:
    torch.manual_seed(seed)
    block = Flux3SingleTransformerBlock(DIM, PUBLISHED["num_attention_heads"], PUBLISHED["attention_head_dim"],
                                        PUBLISHED["mlp_ratio"])
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return block.bfloat16()


def published_block_case(rank: int, world: int) -> dict:
    fused = published_block(0)
    kw = block_inputs(0)
    with torch.no_grad():
        expected = fused(**kw)
        model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
        with CollectiveCounter() as counter:
            got = model(**kw)
    return {
        "errors": [rel_err(g.float(), e.float()) for g, e in zip(got, expected)],
        "collectives": dict(counter.counts),
        "local_bytes": sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters()),
    }


class PublishedWidth(unittest.TestCase):
    def test_one_single_block_in_bf16_on_two_ranks_matches_the_fused_block(self):
        whole = sum(p.nbytes for p in published_block(0).parameters())
        for r in run_on_cpu_ranks(published_block_case, 2):
            self.assertLessEqual(max(r["errors"]), W.BF16_TOL, r["errors"])
            self.assertEqual(r["collectives"], {"all_reduce": 2})  # attention out + feed-forward out
            self.assertLess(r["local_bytes"], 0.51 * whole)  # every Linear sharded; norms replicated


class DropIn(unittest.TestCase):
    def test_classes_stay_diffusers_and_processors_are_twins(self):
        _, _, model = W.make("flux3", "tp_wide")
        stock = {n: type(m) for n, m in model.named_modules()}
        surgery.unfuse(model)
        changed = {n: (stock[n].__name__, type(m).__name__) for n, m in model.named_modules()
                   if n in stock and type(m) is not stock[n]}
        self.assertEqual(set(changed.values()), {("Linear", "SplitRows")}, changed)  # only the ff.linear_in leaves
        self.assertTrue(all(type(m.linear_in) is SplitRows for n, m in model.named_modules() if n.endswith(".ff")))
        twin = head_dim_twin(Flux3AttnProcessor)
        self.assertEqual({type(p) for p in model.attn_processors.values()}, {twin})
        self.assertNotIn("_repeated_blocks", vars(model))  # the class's list names every block already
        surgery.fuse(model)
        self.assertEqual({n: type(m) for n, m in model.named_modules()}, stock)
        self.assertEqual({type(p) for p in model.attn_processors.values()}, {Flux3AttnProcessor})


if __name__ == "__main__":
    unittest.main()
