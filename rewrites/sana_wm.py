"""`SanaWMTransformer3DModel` (diffusers `transformer_sana_wm.py`): the `sana-wm` family (SANA-WM, a bidirectional
camera-controlled world model: Sana's blocks with a gated-delta-net linear attention and a UCPE camera branch).

Every block's self-attention (`BidirectionalGDNUCPESinglePathLiteLA`, every `softmax_every_n`-th block its softmax
counterpart) runs two branches over the same tokens and sums them before one shared output gate and projection. All
it computes is per head: the delta-rule recurrences (`torch_chunk_sana_gdn`, `torch_chunk_cam_single_path_delta_rule`)
keep a `head_dim x head_dim` state per head; the gates `beta` and `decay` have one entry per head (`beta_proj`,
`gate_proj` rows; `A_log`, `dt_bias`); the UCPE transforms and the RMS rescaling act on each head's features; the
temporal short convolutions are depthwise (one filter per channel). Only the q/k RMSNorms normalize the whole width
(`RMSNorm(in_dim)`): `AcrossHeadsNorm`, one all-reduce of a number per token each. So a rank computes its share of
the heads exactly:

- the fused `qkv` becomes a `SplitRows` (q, k, v: views) and the cross attention's `kv_linear` one of k, v; each
  rank's leaf returns its own heads' q, k, v in that order;
- the attention's forward runs as a twin that reads the heads off the tensors, not the stored counts
  (`(..., self.heads, self.dim)` -> `(..., -1, self.dim)`, the flattened width `channels` -> `flatten(2)`), and the
  cross attention's processor likewise (`register_edits`: the installed diffusers source, edited, drift-checked);
- `A_log` and `dt_bias` are `PerHeadParameters`; `gate_proj` leaves a DTensor so that they meet it, and the decay it
  makes enters the recurrence as this rank's local heads (`HeadsInputs`);
- the UCPE ray transforms (made of the camera conditions, whole on every rank) enter the camera recurrence as they
  are, their gradients summed over ranks in backward (`HeadsInputs`): each rank's part comes from its heads only;
- the depthwise convolutions take their rank's channels (`DepthwiseChannels`);
- `out_proj_cam` maps the camera heads back to the full width, which is added to the main branch's heads before the
  gate: rowwise, all-reduced, each rank keeping its heads' columns (`RowwiseIntoHeads`).

Per block: the q/k norms of both branches (4) and of the cross attention (2), `out_proj_cam`, `proj` and the cross
attention's `proj`: 9 all-reduces (6 without camera conditions). The feed-forward (`GLUMBConvTemp`, Conv2d) stays
whole as Sana's does; so does `plucker_proj` (the camera's Plucker embedding into the residual stream: sharding it
would add an all-reduce per block for one hidden x hidden Linear).
"""

from __future__ import annotations

import math

import torch
from diffusers.models.transformers.transformer_sana_wm import (
    BidirectionalGDNUCPESinglePathLiteLA,
    GLUMBConvTemp,
    MultiHeadCrossAttention,
    SanaVideoMSCamCtrlBlock,
    SanaWMCrossAttnProcessor,
    SanaWMTransformer3DModel,
    _SoftmaxUCPESinglePathLiteLA,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.checks import mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.core.leaves import twin
from surgery.extend import Processors, TensorParallel, Tests, derived_family, register_edits, swap_rewrite
from surgery.parallel.derive import (
    AcrossHeadsNorm, ColwiseIntoHeads, DepthwiseChannels, HeadsInputs, PerHeadParameters, RowwiseIntoHeads,
)
from surgery_rewrites.diffusers_common import CONV_FEED_FORWARD, cast_inputs, qkv_rows

# the heads read off the tensors, never the stored counts: the same code runs whole and on a rank's share
_BY_WIDTH = (
    ("reshape(batch_size, seq_len, 3, self.heads, self.dim)", "reshape(batch_size, seq_len, 3, -1, self.dim)", 1),
    ("batch_size, seq_len, self.heads, self.dim", "batch_size, seq_len, -1, self.dim", None),
    ("reshape(batch_size, seq_len, channels)", "flatten(2)", None),
    ("self.cam_heads, self.cam_head_dim", "-1, self.cam_head_dim", 3),
)
register_edits(BidirectionalGDNUCPESinglePathLiteLA, "forward", (
    *((old, new, 5 if count is None else count) for old, new, count in _BY_WIDTH),
    ("reshape(batch_size, num_frames, spatial_size, self.heads)", "reshape(batch_size, num_frames, spatial_size, -1)",
     1),
))
register_edits(_SoftmaxUCPESinglePathLiteLA, "forward",
               tuple((old, new, 2 if count is None else count) for old, new, count in _BY_WIDTH))
register_edits(SanaWMCrossAttnProcessor, "__call__", (
    (".view(batch_size, -1, 2, channels)", ".flatten(1, -2).unflatten(-1, (2, -1))", 1),
    ("view(batch_size, -1, attn.heads, attn.head_dim)", "unflatten(-1, (-1, attn.head_dim))", 3),
    ("reshape(batch_size, -1, channels)", "flatten(2)", 1),
))
HeadDimGDNAttention = twin(BidirectionalGDNUCPESinglePathLiteLA, "HeadDimBidirectionalGDNUCPESinglePathLiteLA",
                           "forward")
HeadDimSoftmaxAttention = twin(_SoftmaxUCPESinglePathLiteLA, "HeadDim_SoftmaxUCPESinglePathLiteLA", "forward")

QKV = qkv_rows("qkv", lambda m: m.qkv.in_features)
REWRITES = (
    swap_rewrite("sana_wm.gdn_attention", BidirectionalGDNUCPESinglePathLiteLA, leaves=(QKV,),
                 unfused_class=HeadDimGDNAttention),
    swap_rewrite("sana_wm.softmax_attention", _SoftmaxUCPESinglePathLiteLA, leaves=(QKV,),
                 unfused_class=HeadDimSoftmaxAttention),
    swap_rewrite("sana_wm.cross_attention", MultiHeadCrossAttention,
                 leaves=(qkv_rows("kv_linear", lambda m: m.d_model, ("k", "v")),),
                 processors=Processors((SanaWMCrossAttnProcessor,))),
)


# the branches' shared part: q/k/v (main and camera) and the output gate colwise, q/k norms across heads, the camera
# output back into this rank's heads, the output projection rowwise
_BRANCHES = {
    **{f"qkv.{p}": ColwiseParallel() for p in "qkv"},
    **{f"{p}_proj_cam": ColwiseParallel() for p in "qkv"},
    **{norm: AcrossHeadsNorm() for norm in ("q_norm", "k_norm", "q_norm_cam", "k_norm_cam")},
    "beta_proj": ColwiseParallel(),
    "gate_proj": ColwiseIntoHeads(),  # meets A_log and dt_bias, heads-sharded DTensors
    "out_proj_cam": RowwiseIntoHeads(),
    "output_gate": ColwiseParallel(),
    "proj": RowwiseParallel(),
    "": PerHeadParameters("A_log", "dt_bias"),
}
GDN_ATTENTION_TP_PLAN = {
    **_BRANCHES,
    **{conv: DepthwiseChannels() for conv in ("conv_q", "conv_k", "conv_v", "conv_q_cam", "conv_k_cam", "conv_v_cam")},
    # attn(query, key, value, beta, decay, recall_gate, T); cam_attn(query, key, value, ray_transforms, beta, decay, T)
    "attn": HeadsInputs(local=(4,)),
    "cam_attn": HeadsInputs(local=(5,), whole=(3,)),
}
# cam_attn(query, key, value, ray_transforms, token_valid_mask=...)
SOFTMAX_ATTENTION_TP_PLAN = {**_BRANCHES, "cam_attn": HeadsInputs(whole=(3,))}
CROSS_ATTENTION_TP_PLAN = {
    "q_linear": ColwiseParallel(),
    "kv_linear.k": ColwiseParallel(),
    "kv_linear.v": ColwiseParallel(),
    "q_norm": AcrossHeadsNorm(),
    "k_norm": AcrossHeadsNorm(),
    "proj": RowwiseParallel(),
}


def check_heads(module: torch.nn.Module, path: str, world: int) -> None:
    heads = module.heads
    if heads % world:
        raise SurgeryError(f"surgery.tensor_parallel: '{path}' holds {heads} heads, which a mesh of {world} cannot "
                           f"split evenly. Use a mesh size that divides {heads}: {mesh_sizes_dividing(heads)}.")


def sana_wm_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SanaWMTransformer3DModel.forward`, as its pipeline passes them: a latent video of
    `image_tokens` patches (two frames or more), per-frame integer timesteps `(batch, 1, frames)`, caption features
    `(batch, 1, tokens, caption_channels)` with their mask (the second sample's last token padding), the raw camera
    conditions `(batch, frames, 20)` (camera-to-world 4x4, then fx, fy, cx, cy: a camera moving along a small arc)
    that drive the UCPE branch (in float32 or float64 on CPU, where diffusers refuses other precisions), and the
    Plucker embedding the post-attention projections read."""
    generator = torch.Generator().manual_seed(seed)
    p_t, p_h, p_w = config.get("patch_size", (1, 1, 1))
    frames = 2 if image_tokens % 2 == 0 else 1
    side = math.isqrt(image_tokens // frames)
    height, width = side * p_h, (image_tokens // frames // side) * p_w
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[1:, -1] = 0
    angles = torch.rand(batch, frames, generator=generator) * 0.3
    c2w = torch.eye(4).repeat(batch, frames, 1, 1)
    c2w[..., 0, 0], c2w[..., 0, 2] = angles.cos(), angles.sin()
    c2w[..., 2, 0], c2w[..., 2, 2] = -angles.sin(), angles.cos()
    c2w[..., :3, 3] = torch.randn(batch, frames, 3, generator=generator) * 0.1
    intrinsics = torch.tensor([width * 1.2, height * 1.2, width / 2, height / 2]).expand(batch, frames, 4)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 128), frames * p_t, height, width,
                                  generator=generator),
        # integers: the forward reads them as `timestep.long()`
        timestep=torch.randint(0, 1000, (batch, 1, frames), generator=generator),
        encoder_hidden_states=torch.randn(batch, 1, text_tokens, config.get("caption_channels", 2304),
                                          generator=generator),
        camera_conditions=torch.cat([c2w.flatten(-2), intrinsics], dim=-1),
        chunk_plucker=torch.randn(batch, config.get("chunk_plucker_channels", 48), frames * p_t, height, width,
                                  generator=generator),
    )
    if torch.device(device).type == "cpu" and dtype not in (torch.float32, torch.float64):
        # diffusers' camera geometry refuses half precision on CPU (`create_grid`: "use float32 or float64"): there
        # the model runs without its camera branch
        del inputs["camera_conditions"]
    return {**cast_inputs(inputs, dtype, device), "encoder_attention_mask": mask.to(device)}


# 4 heads of 24 (worlds 2 and 4 split them; a camera head splits into 4x4 ray blocks and rotary halves), two blocks:
# the first gated-delta, the second softmax (softmax_every_n=2)
_TINY = dict(in_channels=4, num_layers=2, hidden_size=96, num_attention_heads=4, linear_head_dim=24, softmax_every_n=2,
             caption_channels=16, mlp_ratio=2.0, chunk_plucker_channels=8, chunk_plucker_post_attn_blocks=2)


FAMILY = derived_family(
    "sana-wm", SanaWMTransformer3DModel,
    rewrites=REWRITES,
    # the class's defaults are the release (its docstring: "the public Efficient-Large-Model/SANA-WM_bidirectional")
    variants={"1600m": {}},
    sources="diffusers' SanaWMTransformer3DModel defaults, which its docstring gives as the public "
    "Efficient-Large-Model/SANA-WM_bidirectional release (20 blocks, hidden 2240, 20 heads of 112, softmax every "
    "4th block, LTX-2 latents of 128 channels); its config.json unverified here",
    default_variant="1600m",
    example_inputs=sana_wm_inputs,
    tp=TensorParallel(
        plans={HeadDimGDNAttention: GDN_ATTENTION_TP_PLAN, HeadDimSoftmaxAttention: SOFTMAX_ATTENTION_TP_PLAN,
               MultiHeadCrossAttention: CROSS_ATTENTION_TP_PLAN},
        checks={HeadDimGDNAttention: check_heads, HeadDimSoftmaxAttention: check_heads,
                MultiHeadCrossAttention: check_heads},
        replicated={GLUMBConvTemp: {"*conv*": CONV_FEED_FORWARD + " (its temporal conv too)"},
                    SanaVideoMSCamCtrlBlock: {
            "plucker_proj": "the camera's Plucker embedding into the residual stream (every rank holds it whole): "
                            "sharded, it would cost an all-reduce per block"}},
    ),
    tests=Tests(
        # its softmax blocks run scaled_dot_product_attention in bfloat16 even in a float32 model (the stock code
        # casts q/k/v: "SDPA / FlashAttention only supports bf16/fp16"), so the gradients of everything before them
        # agree to bfloat16's precision only (measured: 2.2e-4 at world 2; the forward to 4e-7)
        rounds_to=torch.bfloat16,
        configs={"tiny": _TINY,
                 # gated-delta blocks only, all float32: tests/families/test_sana_wm.py holds it to float32's bounds
                 "gdn_tiny": {**_TINY, "softmax_every_n": 0}},
    ),
)
