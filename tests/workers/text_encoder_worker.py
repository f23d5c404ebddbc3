"""What each gloo rank runs for the text-encoder tests: every family's encoder sharded, against one device."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
import text_encoder_testing as E
from surgery.testing import rel_err


def _sharded(encoder) -> list[str]:
    return sorted({n for n, p in encoder.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()})


def run(rank: int, world: int, folder: str | None = None) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    tokens, mask = E.ids()
    for name, (build, _) in E.ENCODERS.items():
        encoder = build(0)
        expected = E.outputs(encoder, tokens, mask)
        surgery.tensor_parallel(encoder, mesh)
        got = E.outputs(encoder, tokens, mask)
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in encoder.parameters())
        out[name] = {
            "error": max(rel_err(g, e) for g, e in zip(got, expected)),
            "outputs": len(expected),
            "sharded": _sharded(encoder),
            "local_fraction": local / sum(p.numel() for p in build(0).parameters()),
        }
    for name, build, kwargs in (("mistral3_kv", E.mistral3, dict(num_key_value_heads=1)),
                                ("t5_heads", E.t5, dict(num_heads=3))):
        try:
            surgery.tensor_parallel(build(0, **kwargs), mesh)
            out[f"refusal_{name}"] = None
        except surgery.SurgeryError as error:
            out[f"refusal_{name}"] = str(error)
    if world == 2:  # one worker process per world size: the 2-rank one also runs the published-width layers
        out["published"] = run_published(rank, world, mesh)
        out["pipelines"] = run_pipelines(rank, world, mesh)
    if folder is not None:
        out["loading"] = run_loading(rank, world, mesh, folder)
    return out


def run_pipelines(rank: int, world: int, mesh) -> dict:
    """FLUX.2-dev, FLUX.1 and QwenImage pipelines: the single-device image, then every component sharded."""
    import pipeline_testing as P
    import whole_pipeline_testing as WP

    out = {}
    for kind, build in WP.PIPELINES.items():
        pipe = build(0)
        expected = WP.generate(kind, pipe)
        report = surgery.tensor_parallel_pipeline(pipe, mesh)
        got = WP.generate(kind, pipe)
        out[kind] = {"error": rel_err(got, expected), "psnr": P.psnr(got, expected), "std": float(expected.std()),
                     "report": [{k: r[k] for k in ("component", "class", "sharded", "reason")} for r in report]}
    return out


def run_published(rank: int, world: int, mesh) -> dict:
    """One layer of Mistral3 (FLUX.2-dev), T5-XXL, UMT5-XXL (Wan) and Qwen2.5-VL's text model at published width,
    bf16."""
    out = {}
    tokens = torch.randint(0, E.PUBLISHED_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[1, 12:] = 0
    for name in ("mistral3", "t5_xxl", "umt5_xxl", "qwen25_vl_text"):
        encoder = E.published_layer(name)
        expected = E.outputs(encoder, tokens, mask)
        surgery.tensor_parallel(surgery.unfuse(encoder), mesh)
        got = E.outputs(encoder, tokens, mask)
        out[name] = {"error": max(rel_err(g.float(), e.float()) for g, e in zip(got, expected)),
                     "largest": max(p.numel() for p in encoder.parameters()),
                     "sharded": len(_sharded(encoder))}
        del encoder, expected, got
    return out


LOADED = ("mistral3", "qwen3_causal", "qwen25_vl", "t5")


def save_text_encoders(folder: str) -> None:
    """Each of `LOADED` saved as a pipeline's `text_encoder/` (transformers' layout, sharded with an index)."""
    for name in LOADED:
        E.ENCODERS[name][0](0).save_pretrained(f"{folder}/{name}/text_encoder", max_shard_size="100KB")


def run_loading(rank: int, world: int, mesh, folder: str) -> dict:
    """`load_tensor_parallel` of each saved encoder: its outputs, and its shards against `tensor_parallel`'s."""
    out = {}
    tokens, mask = E.ids()
    for name in LOADED:
        build = E.ENCODERS[name][0]
        expected = E.outputs(build(0), tokens, mask)
        loaded = surgery.load_tensor_parallel(None, f"{folder}/{name}", mesh, subfolder="text_encoder",
                                              progress=False)
        reference = surgery.tensor_parallel(build(0), mesh, src_data_rank=None)
        ours, theirs = dict(loaded.named_parameters()), dict(reference.named_parameters())
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        out[name] = {
            "error": max(rel_err(g, e) for g, e in zip(E.outputs(loaded, tokens, mask), expected)),
            "same_names": sorted(ours) == sorted(theirs),
            "bitwise": all(torch.equal(local(ours[n]), local(theirs[n])) and type(ours[n]) is type(theirs[n])
                           for n in theirs if n in ours),
            "shards": sum(isinstance(p, DTensor) and p.placements[0].is_shard() for p in ours.values()),
            "files": len(__import__("os").listdir(f"{folder}/{name}/text_encoder")),
        }
    return out


# what the DiTs' encoders may not split over 2 ranks: (name, builder, config overrides)
DIT_REFUSALS = (("umt5_heads", E.umt5, dict(num_heads=3)),
                ("clip_heads", E.clip, dict(hidden_size=48, num_attention_heads=3)),
                ("glm_kv_heads", E.glm, dict(num_key_value_heads=1)))


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A fixed random weighting of every output: its gradient reaches every parameter the outputs depend on."""
    generator = torch.Generator().manual_seed(1)
    return sum((o * torch.randn(o.shape, generator=generator)).sum() for o in outputs)


def _grads(encoder) -> dict[str, torch.Tensor]:
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    return {n: full(p.grad) for n, p in encoder.named_parameters() if p.grad is not None}


def _grad_error(got: dict, expected: dict) -> float:
    """The worst parameter's gradient error, relative to its own size. A gradient that is zero in exact arithmetic
    (a key bias: softmax ignores a shift every key shares) holds rounding noise only: one under 1 % of the largest
    is measured against that 1 %."""
    largest = max(g.abs().max() for g in expected.values())
    return max(((got[n] - g).abs().max() / max(g.abs().max(), 1e-2 * largest)).item() for n, g in expected.items())


def run_dit_encoders(rank: int, world: int) -> dict:
    """The DiTs' text encoders (`E.DIT_ENCODERS`): unfused (where registered) and sharded, against one device,
    forward and backward; the collectives one forward makes; and the configs the mesh cannot split."""
    from surgery.testing import CollectiveCounter

    mesh = init_device_mesh("cpu", (world,))
    tokens, mask = E.ids()
    out = {}
    for name, (build, _) in E.DIT_ENCODERS.items():
        encoder = build(0)
        expected = E.outputs(encoder, tokens, mask)
        with torch.enable_grad():
            _loss(encoder(input_ids=tokens, attention_mask=mask, output_hidden_states=True).hidden_states).backward()
        expected_grads = _grads(encoder)
        encoder = build(0)
        surgery.tensor_parallel(surgery.unfuse(encoder), mesh)
        got = E.outputs(encoder, tokens, mask)
        with CollectiveCounter() as counter, torch.no_grad():
            encoder(input_ids=tokens, attention_mask=mask)
        with torch.enable_grad():
            hidden = encoder(input_ids=tokens, attention_mask=mask, output_hidden_states=True).hidden_states
            _loss([h.full_tensor() if isinstance(h, DTensor) else h for h in hidden]).backward()
        grads = _grads(encoder)
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in encoder.parameters())
        out[name] = {
            "error": max(rel_err(g, e) for g, e in zip(got, expected)),
            "grad_error": _grad_error(grads, expected_grads),
            "grads": len(grads), "expected_grads": len(expected_grads),
            "outputs": len(expected),
            "collectives": dict(counter.counts),
            "sharded": _sharded(encoder),
            "local_fraction": local / sum(p.numel() for p in build(0).parameters()),
            "classes": sorted({type(m).__name__ for m in encoder.modules()}),
        }
    for name, build, overrides in DIT_REFUSALS:
        try:
            surgery.tensor_parallel(surgery.unfuse(build(0, **overrides)), mesh)
            out[f"refusal_{name}"] = None
        except surgery.SurgeryError as error:
            out[f"refusal_{name}"] = str(error)
    return out
