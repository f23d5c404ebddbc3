"""World-N worker for tests/families/test_ltx.py (LTX-Video and LTX-2 at two blocks, sharded, against the single-device
stock model, in float64: at two blocks these seeded models' q/k gradients are too ill-conditioned for an fp32
comparison, rewrites/ltx.py, rewrites/ltx2.py) and tests/families/test_sana_wm_refiner.py (SANA-WM's refiner, its
cached forwards)."""

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery

CASES = (("ltx-video", "tiny_2_blocks"), ("ltx-2", "tiny_2.3"), ("ltx-2", "tiny_2.0_interleaved"))


def two_blocks(rank: int, world: int) -> dict:
    out = {}
    for family_name, config_name in CASES:
        family, config, fused = W.make(family_name, config_name, 0, torch.float64)
        kw = W.inputs(family, config, 0, torch.float64)
        model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
        result = {"expected_all_reduces": family.tp.all_reduces(config)}
        with torch.no_grad():
            with W.CollectiveCounter() as counter:
                result["forward"] = W.rel_err(W.output(model, kw), W.output(fused, kw))
        result["collectives"] = dict(counter.counts)
        (ref_in, ref), (tp_in, tp) = W.gradients(fused, kw, 0), W.gradients(model, kw, 0)
        result["param_grads"] = max(W.gradient_errors(tp, ref).values())
        result["input_grads"] = max(W.rel_err(tp_in[k], g) for k, g in ref_in.items())
        out[f"{family_name}/{config_name}"] = result
    return out


def refiner_kv_cache(rank: int, world: int) -> dict:
    """SANA-WM's refiner through its sliding-window KV cache, as its pipeline drives it: capture the sink's pre-RoPE
    K/V, refine a block against `[sink, current]` capturing its post-RoPE K/V as history, then one against
    `[sink, history, current]`; every rank caches its own heads. Outputs of both cached forwards vs the stock model."""
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache

    out = {}
    for config_name in ("tiny", "tiny_interleaved"):
        family, config, fused = W.make("sana-wm-refiner", config_name, 0, torch.float64)
        model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
        sink, first, second = (W.inputs(family, config, seed, torch.float64) for seed in (0, 1, 2))

        def cached(m):
            cache = SanaWMRefinerKVCache(len(m.transformer_blocks))
            with torch.no_grad():
                m(**sink, kv_cache=cache, kv_cache_mode="capture_pre_rope")
                for layer in cache.layer_caches:
                    layer.store_sink(*layer.get_captured_pre_rope())
                cache.sink_pe = sink["video_rotary_emb"]
                a = W.output(m, {**first, "kv_cache": cache, "kv_cache_mode": "inject_and_capture_post_rope"})
                for layer in cache.layer_caches:
                    layer.store_history(*layer.get_captured_post_rope())
                with W.CollectiveCounter() as counter:
                    b = W.output(m, {**second, "kv_cache": cache, "kv_cache_mode": "inject"})
            return a, b, dict(counter.counts)

        (a, b, _), (ta, tb, collectives) = cached(fused), cached(model)
        out[config_name] = {"first": W.rel_err(ta, a), "second": W.rel_err(tb, b), "collectives": collectives,
                            "expected_all_reduces": family.tp.all_reduces(config)}
    return out
