"""World-N worker for tests/families/test_wan_animate_2.py: Wan-Animate-2's two passes, sharded, against the
single-device stock model. The reference pass (`kv_cache_mode="extract"`) fills each layer's K/V cache, the
denoising pass (`"cached"`) attends over the generation tokens and the cached reference through flex attention's
block mask, as diffusers' own test drives them (one 5-frame 32x32 segment; flex attention has no backward on CPU,
so both run without gradients). The cached pass's flex attention does not run under a dispatch mode (it then
insists on compiling), so its collectives are counted where DTensor issues them, its functional collectives, and the
reference pass is counted both ways."""

import contextlib
import copy
from collections import Counter
from unittest import mock

import torch
import torch.distributed._functional_collectives as funcol
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery


def generation_inputs(reference: dict, config: dict, cache: WanAnimate2KVCache, seed: int) -> dict:
    """One denoising step against `cache`: one latent frame more than the reference (the reference image's slot)."""
    generator = torch.Generator().manual_seed(seed)
    frames, side = (int(n) for n in reference["offset_grid_sizes"][0, :2])
    latent, condition = reference["hidden_states"][0].shape[0], reference["condition_latents"][0].shape[0]
    shape = (frames + 1, *reference["hidden_states"][0].shape[2:])
    return {**reference, "kv_cache": cache, "kv_cache_mode": "cached", "seq_len": (frames + 1) * side * side,
            "hidden_states": [torch.randn(latent, *shape, generator=generator)],
            "condition_latents": [torch.randn(condition, *shape, generator=generator)],
            "timestep": torch.tensor([500.0]), "reference_grid_sizes": reference["offset_grid_sizes"],
            "origin_len": 4 * (frames - 1) + 1, "origin_area": [8 * shape[1], 8 * shape[2]]}


@contextlib.contextmanager
def functional_collectives():
    """Counts each functional collective called inside (by name): what DTensor issues for a style or an op."""
    counts: Counter = Counter()

    def counted(name):
        original = getattr(funcol, name)

        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return call

    names = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(funcol, name, counted(name)))
        yield counts


def two_passes(rank: int, world: int) -> dict:
    family, config, fused = W.make("wan-animate-2", "tiny", 0)
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
    reference = family.example_inputs(config, batch=1, seed=0)

    def passes(m):
        cache = WanAnimate2KVCache(config["num_layers"])
        with torch.no_grad():
            with W.CollectiveCounter() as extract, functional_collectives() as extract_calls:
                a = W.output(m, {**reference, "kv_cache": cache})
            with functional_collectives() as cached_calls:
                b = W.output(m, generation_inputs(reference, config, cache, seed=1))
        return a, b, cache, {"extract": dict(extract.counts), "extract_calls": dict(extract_calls),
                             "cached_calls": dict(cached_calls)}

    (a, b, cache, _), (ta, tb, tcache, collectives) = passes(fused), passes(model)
    return {"extract": W.rel_err(ta, a), "cached": W.rel_err(tb, b), "collectives": collectives,
            "expected_all_reduces": family.tp.all_reduces(config),
            # each rank caches its own heads' k/v, the stock cache's slice of them
            "cache_shapes": [tuple(layer.key.shape) for layer in tcache.layer_caches],
            "cache_is_this_ranks_heads": all(
                torch.allclose(mine.key, whole.key.chunk(world, 2)[rank], atol=1e-5)
                for mine, whole in zip(tcache.layer_caches, cache.layer_caches))}
