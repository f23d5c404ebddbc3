"""Rank job for the split VAE decode: each VAE class (a tiny seeded config, diffusers' test configs) decoded by
`surgery.decode_parallel` against diffusers' own single-device tiled decode of the same latents on the same rank."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import diffusers

VIDEO_3D = ("CogVideoXDownBlock3D", "HunyuanVideoDownBlock3D")


def _kl(cls_name: str) -> dict:
    return {"cls": cls_name, "config": {
        "block_out_channels": [4, 8], "in_channels": 3, "out_channels": 3, "latent_channels": 4, "norm_num_groups": 2,
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
        "sample_size": 16}, "latents": (1, 4, 20, 20), "tiling": {}}


# name -> class, config, latent shape, the tile sizes given to `enable_tiling`, and temporal tiling on or off
CASES = {
    "AutoencoderKL": _kl("AutoencoderKL"),
    "AutoencoderKLFlux2": _kl("AutoencoderKLFlux2"),
    "AutoencoderKLWan": {"cls": "AutoencoderKLWan", "config": {
        "base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
        "temperal_downsample": [False, True, True]},
        "latents": (1, 16, 3, 7, 7), "tiling": {"tile_sample_min_height": 32, "tile_sample_min_width": 32,
                                                 "tile_sample_stride_height": 24, "tile_sample_stride_width": 24}},
    "AutoencoderKLCogVideoX": {"cls": "AutoencoderKLCogVideoX", "config": {
        "in_channels": 3, "out_channels": 3, "down_block_types": ["CogVideoXDownBlock3D"] * 4,
        "up_block_types": ["CogVideoXUpBlock3D"] * 4, "block_out_channels": [8, 8, 8, 8], "latent_channels": 4,
        "layers_per_block": 1, "norm_num_groups": 2, "temporal_compression_ratio": 4},
        "latents": (1, 4, 5, 7, 7), "tiling": {"tile_sample_min_height": 32, "tile_sample_min_width": 32,
                                                "tile_overlap_factor_height": 0.25, "tile_overlap_factor_width": 0.25}},
    "AutoencoderKLHunyuanVideo": {"cls": "AutoencoderKLHunyuanVideo", "config": {
        "in_channels": 3, "out_channels": 3, "latent_channels": 4, "down_block_types": ["HunyuanVideoDownBlock3D"] * 4,
        "up_block_types": ["HunyuanVideoUpBlock3D"] * 4, "block_out_channels": [8, 8, 8, 8], "layers_per_block": 1,
        "act_fn": "silu", "norm_num_groups": 4, "scaling_factor": 0.476986, "spatial_compression_ratio": 8,
        "temporal_compression_ratio": 4, "mid_block_add_attention": True},
        "latents": (1, 4, 4, 7, 7), "tiling": {"tile_sample_min_height": 32, "tile_sample_min_width": 32,
                                                "tile_sample_stride_height": 24, "tile_sample_stride_width": 24,
                                                "tile_sample_min_num_frames": 8, "tile_sample_stride_num_frames": 4},
        "framewise": True},
    "AutoencoderKLLTXVideo": {"cls": "AutoencoderKLLTXVideo", "config": {
        "in_channels": 3, "out_channels": 3, "latent_channels": 8, "block_out_channels": [8, 8, 8, 8],
        "decoder_block_out_channels": [8, 8, 8, 8], "layers_per_block": [1, 1, 1, 1, 1],
        "decoder_layers_per_block": [1, 1, 1, 1, 1], "spatio_temporal_scaling": [True, True, False, False],
        "decoder_spatio_temporal_scaling": [True, True, False, False],
        "decoder_inject_noise": [False, False, False, False, False], "upsample_residual": [False, False, False, False],
        "upsample_factor": [1, 1, 1, 1], "timestep_conditioning": False, "patch_size": 1, "patch_size_t": 1,
        "encoder_causal": True, "decoder_causal": False},
        "latents": (1, 8, 5, 7, 7), "tiling": {"tile_sample_min_height": 16, "tile_sample_min_width": 16,
                                                "tile_sample_stride_height": 12, "tile_sample_stride_width": 12,
                                                "tile_sample_min_num_frames": 8, "tile_sample_stride_num_frames": 4},
        "framewise": True},
}


def build(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor]:
    """The case's VAE (seeded weights, tiles set, tiling then switched off again) and its seeded latents."""
    case = CASES[name]
    torch.manual_seed(0)
    vae = getattr(diffusers, case["cls"])(**case["config"]).to(device, dtype).eval()
    vae.enable_tiling(**case["tiling"])
    vae.disable_tiling()
    if case.get("framewise"):
        vae.use_framewise_decoding = True
    latents = torch.randn(case["latents"], generator=torch.Generator().manual_seed(1)).to(device, dtype)
    return vae, latents


def tiling_state(vae: nn.Module) -> dict:
    return {k: v for k, v in vae.__dict__.items() if k.startswith(("use_", "tile_"))}


class ComputedTiles:
    """Counts the decoder calls a rank computes: its first conv giving a real tensor (not one on the meta device)."""

    def __init__(self, vae: nn.Module):
        self.calls = 0
        self.handle = vae.decoder.conv_in.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        output = output[0] if isinstance(output, tuple) else output  # CogVideoX's convs: (output, cache)
        if not output.is_meta:
            self.calls += 1


def tiled_reference(vae: nn.Module, latents: torch.Tensor) -> tuple[torch.Tensor, int]:
    """diffusers' own tiled decode on this rank alone, and how many decoder calls it made."""
    counter = ComputedTiles(vae)
    vae.enable_tiling()
    try:
        with torch.no_grad():
            out = vae.decode(latents).sample
    finally:
        vae.disable_tiling()
        counter.handle.remove()
    return out, counter.calls


def decode_job(rank: int, world: int, name: str) -> dict:
    import surgery
    from surgery.parallel.distributed import CollectiveCounter

    mesh = init_device_mesh("cpu", (world,))
    vae, latents = build(name)
    reference, reference_calls = tiled_reference(vae, latents)
    before = tiling_state(vae)
    surgery.decode_parallel(vae, mesh)
    computed = ComputedTiles(vae)
    with torch.no_grad(), CollectiveCounter() as counter:
        out = vae.decode(latents).sample
    computed.handle.remove()
    return {
        "shape": tuple(out.shape), "reference_shape": tuple(reference.shape),
        "bitwise": torch.equal(out, reference), "max_abs": (out - reference).abs().max().item(),
        "scale": reference.abs().max().item(),
        "collectives": dict(counter.counts), "computed_calls": computed.calls, "reference_calls": reference_calls,
        "state_restored": tiling_state(vae) == before, "use_tiling_after": vae.use_tiling,
        "checksum": float(out.double().sum()),
    }


def decode_all(rank: int, world: int, names: tuple[str, ...]) -> dict:
    """`decode_job` of each case in one job (a spawned job costs more here than the tiny decodes)."""
    return {name: decode_job(rank, world, name) for name in names}


def refusals(rank: int, world: int) -> dict:
    """What is refused, on every rank at once: a VAE without diffusers' tiled decode, and latents that differ
    between the ranks (every rank raises, none waits in the gather)."""
    import surgery

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    torch.manual_seed(0)
    whole = diffusers.AutoencoderKLTemporalDecoder(block_out_channels=(32,), latent_channels=4)
    try:
        surgery.decode_parallel(whole, mesh)
        out["no_tiles"] = None
    except surgery.SurgeryError as error:
        out["no_tiles"] = str(error)
    out["no_tiles_untouched"] = "decode" not in whole.__dict__
    vae, latents = build("AutoencoderKL")
    surgery.decode_parallel(vae, mesh)
    if rank == world - 1:
        latents = latents[..., :-4]
    before = tiling_state(vae)
    try:
        with torch.no_grad():
            vae.decode(latents)
        out["differing_latents"] = None
    except surgery.SurgeryError as error:
        out["differing_latents"] = str(error)
    out["state_after_refusal"] = tiling_state(vae) == before
    # with gradients on, the VAE decodes whole: diffusers' own untiled decode, gradients included
    vae.requires_grad_(True)
    same = build("AutoencoderKL")[1]
    got = vae.decode(same).sample
    expected_vae = build("AutoencoderKL")[0]
    out["grad_decode_whole"] = torch.equal(got.detach(), expected_vae.decode(same).sample.detach())
    out["grad_flows"] = got.requires_grad
    return out


def pipeline_job(rank: int, world: int) -> dict:
    """The tiny FLUX.1 pipeline at 64x64 (4 VAE tiles): `tensor_parallel_pipeline` against the single-device
    pipeline with diffusers' tiled decode on."""
    import surgery
    import whole_pipeline_testing as WP
    from surgery.testing import rel_err

    mesh = init_device_mesh("cpu", (world,))

    def image(pipe):
        return pipe(prompt="a red fox in fresh snow", height=64, width=64, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output_type="pt", max_sequence_length=16,
                    guidance_scale=3.5).images

    pipe = WP.flux1_pipeline(0)
    pipe.vae.enable_tiling()
    expected = image(pipe)
    pipe.vae.disable_tiling()
    report = surgery.tensor_parallel_pipeline(pipe, mesh)
    computed = ComputedTiles(pipe.vae)
    got = image(pipe)
    computed.handle.remove()
    return {"error": rel_err(got, expected), "std": float(expected.std()), "computed_calls": computed.calls,
            "use_tiling_after": pipe.vae.use_tiling,
            "report": {r["component"]: (r["sharded"], r["reason"]) for r in report}}
