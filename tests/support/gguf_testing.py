"""GGUF FLUX.2 checkpoints for the tests, written from a seeded model with the `gguf` package's writer in the layout
diffusers' `Flux2Transformer2DModel.from_single_file` reads (BFL's original names, q/k/v fused, `final_layer`'s
shift/scale order), the Linears quantized where their rows are whole blocks and the rest F32 (as GGUF converters
keep norms and biases)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch


# BFL name -> diffusers name, the inverse of diffusers' `convert_flux2_transformer_checkpoint_to_diffusers` renames
_RENAMES = [
    (r"^x_embedder\.", "img_in."),
    (r"^context_embedder\.", "txt_in."),
    (r"^time_guidance_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"^time_guidance_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"^time_guidance_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"^time_guidance_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (r"^(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear\.", r"\1.lin."),
    (r"^proj_out\.", "final_layer.linear."),
    (r"^norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_q\.weight$", r"double_blocks.\1.img_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_k\.weight$", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_q\.weight$", r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_k\.weight$", r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.ff\.linear_in\.", r"double_blocks.\1.img_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff\.linear_out\.", r"double_blocks.\1.img_mlp.2."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.linear_in\.", r"double_blocks.\1.txt_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.linear_out\.", r"double_blocks.\1.txt_mlp.2."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj\.", r"single_blocks.\1.linear1."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_out\.", r"single_blocks.\1.linear2."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_q\.weight$", r"single_blocks.\1.norm.query_norm.scale"),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_k\.weight$", r"single_blocks.\1.norm.key_norm.scale"),
]
_QKV = re.compile(r"^transformer_blocks\.(\d+)\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)\.weight$")


def bfl_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under BFL's original names (what a GGUF FLUX.2 checkpoint holds)."""
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for index in sorted({int(m.group(1)) for k in sd if (m := _QKV.match(k))}):
        a = f"transformer_blocks.{index}.attn"
        out[f"double_blocks.{index}.img_attn.qkv.weight"] = torch.cat(
            [sd.pop(f"{a}.to_{p}.weight") for p in "qkv"])
        out[f"double_blocks.{index}.txt_attn.qkv.weight"] = torch.cat(
            [sd.pop(f"{a}.add_{p}_proj.weight") for p in "qkv"])
    for key, value in sd.items():
        new = key
        for pattern, replacement in _RENAMES:
            new, n = re.subn(pattern, replacement, new)
            if n:
                break
        else:
            raise KeyError(f"no BFL name for {key}")
        if key.startswith("norm_out.linear."):  # diffusers holds (scale, shift), BFL (shift, scale)
            scale, shift = value.chunk(2)
            value = torch.cat([shift, scale])
        out[new] = value
    return out


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """Q4_K blocks (256 columns: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of 4-bit
    values) of a float matrix, rows x (columns / 256 * 144) bytes: the `gguf` package reads them but cannot write
    them. A plain min/max fit per 32-column sub-block; what matters here is valid Q4_K bytes."""
    rows, cols = weights.shape
    x = weights.astype(np.float32).reshape(-1, 8, 32)  # blocks x sub-blocks x values
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15
    mn = -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mn, dminf, out=np.zeros_like(mn), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.rint(np.divide(x + (dminf * m)[..., None], step, out=np.zeros_like(x), where=step > 0))
    q = np.clip(q, 0, 15).astype(np.uint8)
    scales = np.empty((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2j (low nibbles), 2j + 1 (high)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], 1)
    return blocks.reshape(rows, cols // 256 * 144)


def quantize(weights: np.ndarray, kind: str) -> tuple[np.ndarray, object]:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q4_K":
        return quantize_q4_k(weights), qtype
    return gguf.quants.quantize(weights.astype(np.float32), qtype), qtype


def quantized_names(state: dict[str, torch.Tensor], kind: str, only: str | None = None) -> list[str]:
    """Every Linear weight whose rows are whole blocks (`only`: a regex they must match too), as GGUF converters
    quantize (and `surgery plan --quant` counts); the rest (norms, biases, narrow inputs) stays F32."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    return [k for k, v in state.items()
            if k.endswith(".weight") and v.ndim == 2 and v.shape[1] % block == 0 and (only is None or re.search(only, k))]


def write_gguf(model, path: Path, kind: str, only: str | None = None) -> Path:
    """`model` as a GGUF FLUX.2 checkpoint with its Linears quantized to `kind` (Q8_0, Q4_0, Q4_K, F32), and a
    config.json beside it (`path.parent`) for `from_single_file(config=...)`."""
    state = bfl_state_dict(model)
    quantized = set(quantized_names(state, kind, only)) if kind != "F32" else set()
    return write_stored(model, path, lambda name, array: quantize(array, kind) if name in quantized else None)


def write_stored(model, path: Path, stored) -> Path:
    """`model` as a GGUF FLUX.2 checkpoint, each tensor as `stored(BFL name, float32 array)` gives it: `(bytes,
    GGML type)`, or None for F32; config.json beside it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "flux")
    for name, value in bfl_state_dict(model).items():
        array = value.numpy()
        raw = stored(name, array)
        if raw is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, raw[0], raw_dtype=raw[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_config(model, path.parent)
    return path


def write_config(model, folder: Path) -> None:
    """The model's config.json in `folder`, as `from_single_file(config=folder)` reads it."""
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    (folder / "config.json").write_text(json.dumps({"_class_name": type(model).__name__, **config}))


def load_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """The GGUF checkpoint loaded whole by diffusers (its `GGUFLinear`s)."""
    from diffusers import Flux2Transformer2DModel, GGUFQuantizationConfig

    return Flux2Transformer2DModel.from_single_file(
        str(path), config=str(path.parent), quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        torch_dtype=dtype)


# width enough for Q4_K's 256-column blocks to survive a rowwise cut over 2 ranks: inner 512 -> 256 per rank, MLP
# hidden 1536 -> 768; one block of each kind
GGUF_CONFIG = dict(num_layers=1, num_single_layers=1, num_attention_heads=4, attention_head_dim=128,
                   joint_attention_dim=256, mlp_ratio=3.0, in_channels=16, timestep_guidance_channels=32,
                   guidance_embeds=True, axes_dims_rope=(32, 32, 32, 32))


def write_fp8(model, path: Path) -> Path:
    """`model` as BFL's fp8r single file (safetensors): each Linear's `weight` float8_e4m3fn with its per-row
    `weight_scale` (diffusers' own `quantize_fp8r`), the rest F32; config.json beside it."""
    from diffusers.quantizers.bfl.utils import quantize_fp8r
    from safetensors.torch import save_file

    state = bfl_state_dict(model)
    out = {}
    for name, value in state.items():
        if name.endswith(".weight") and value.ndim == 2:
            out[name], out[f"{name}_scale"] = quantize_fp8r(value)
        else:
            out[name] = value
    save_file(out, str(path))
    write_config(model, path.parent)
    return path


def load_fp8(path: Path, dtype: torch.dtype = torch.float32):
    """The fp8r checkpoint loaded whole by diffusers (its `BFLFP8RLinear`s)."""
    from diffusers import BFLQuantizationConfig, Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_single_file(
        str(path), config=str(path.parent), quantization_config=BFLQuantizationConfig(compute_dtype=dtype),
        torch_dtype=dtype)
