"""What each gloo rank runs for the pipeline / text-encoder / compile tests."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import pipeline_testing as P
import surgery
from flux2_testing import build, inputs, rel_err, small_config


def run(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}

    pipe = P.klein_pipeline(0)
    surgery.tensor_parallel(surgery.unfuse(pipe.transformer), mesh)
    out["image_transformer_tp"] = P.generate(pipe)
    surgery.tensor_parallel(pipe.text_encoder, mesh)
    out["image_both_tp"] = P.generate(pipe)

    encoder = P.text_encoder(300, seed=1)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        expected = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        surgery.tensor_parallel(encoder, mesh)
        got = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    out["text_encoder"] = max(rel_err(g, e) for g, e in zip(got, expected))
    out["text_encoder_sharded"] = sorted({n.rsplit(".", 2)[-2] for n, p in encoder.named_parameters()
                                          if type(p).__name__ == "DTensor" and p.placements[0].is_shard()})
    try:
        surgery.tensor_parallel(P.text_encoder(300, seed=1, heads=4, kv_heads=1), mesh)
        out["kv_heads_refusal"] = None
    except surgery.SurgeryError as error:
        out["kv_heads_refusal"] = str(error)
    return out


def run_compiled(rank: int, world: int) -> dict:
    """torch.compile (inductor) of a sharded model: its own job, in the heavy tier (each rank compiles for ~30 s)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    config = dict(small_config("tp_wide"), num_layers=1, num_single_layers=1)
    kw = inputs(config, 0)
    with torch.no_grad():
        expected = build(config, 0)(**kw).sample
        model = surgery.tensor_parallel(surgery.unfuse(build(config, 0)), mesh)
        try:
            out["compiled_tp"] = rel_err(torch.compile(model)(**kw).sample, expected)
        except Exception as error:  # reported to the test, which prints it
            out["compiled_tp"] = f"{type(error).__name__}: {error}"
    return out
