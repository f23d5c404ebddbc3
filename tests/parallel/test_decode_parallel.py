"""`surgery.decode_parallel`: the VAE's decode split across gloo ranks equals diffusers' single-device tiled decode,
bitwise, for each VAE class, with each tile computed once and the collectives per decode counted."""

import functools
import unittest

from parameterized import parameterized

from surgery.parallel.distributed import run_on_cpu_ranks
from surgery.testing import FP32_TOL
import decode_worker as W

# per decode: the agreement (one all_gather_object: sizes, then payload) and the tiles' one all_gather
COLLECTIVES = {"allgather_": 3}


@functools.lru_cache(maxsize=None)
def decoded(world: int) -> tuple[dict, ...]:
    return tuple(run_on_cpu_ranks(W.decode_all, world, tuple(W.CASES), timeout=1800))


class SplitDecode(unittest.TestCase):
    @parameterized.expand([(name, world) for world in (2, 4) for name in W.CASES])
    def test_equals_the_single_device_tiled_decode(self, name, world):
        rows = [ranks[name] for ranks in decoded(world)]
        for rank, row in enumerate(rows):
            print(f"\n{name}, {world} ranks, rank {rank}: {row['shape']}, max abs diff {row['max_abs']:.1e}, "
                  f"{row['computed_calls']} of {row['reference_calls']} decoder calls, {row['collectives']}")
            self.assertEqual(row["shape"], row["reference_shape"])
            self.assertTrue(row["bitwise"], row["max_abs"])
            self.assertEqual(row["collectives"], COLLECTIVES)
            self.assertTrue(row["state_restored"])
            self.assertFalse(row["use_tiling_after"])
            self.assertGreater(row["computed_calls"], 0)  # every rank has a share
        # every tile decoded once, on one rank
        self.assertEqual(sum(r["computed_calls"] for r in rows), rows[0]["reference_calls"])
        self.assertEqual(len({r["checksum"] for r in rows}), 1)


class Refusals(unittest.TestCase):
    def test_every_rank_refuses_together(self):
        for rank, out in enumerate(run_on_cpu_ranks(W.refusals, 2, timeout=900)):
            print(f"\nrank {rank}: {out['no_tiles']}\nrank {rank}: {out['differing_latents']}")
            self.assertIn("AutoencoderKLTemporalDecoder has no tiled_decode", out["no_tiles"])
            self.assertTrue(out["no_tiles_untouched"])
            self.assertIn("differ", out["differing_latents"], rank)
            self.assertTrue(out["state_after_refusal"])
            self.assertTrue(out["grad_decode_whole"])
            self.assertTrue(out["grad_flows"])


class Pipeline(unittest.TestCase):
    def test_pipeline_splits_the_decode_and_gives_the_tiled_image(self):
        rows = run_on_cpu_ranks(W.pipeline_job, 2, timeout=1800)
        for rank, out in enumerate(rows):
            print(f"\nFLUX.1 pipeline over 2 ranks, rank {rank}: rel err {out['error']:.1e} vs the single-device "
                  f"tiled decode; {out['computed_calls']} decoder calls here")
            self.assertGreater(out["std"], 0.01)
            self.assertLessEqual(out["error"], FP32_TOL)
            self.assertFalse(out["use_tiling_after"])
            sharded, reason = out["report"]["vae"]
            self.assertFalse(sharded)
            self.assertIn("decode split over 2 ranks", reason)
        self.assertEqual(sum(r["computed_calls"] for r in rows), 9)  # 64x64: latents 32x32, tiles of 16 by 12
