"""World-2 worker for tests/families/test_dreamlite.py: DreamLite's UNet with each of its transformers sharded, against
the single-device stock UNet."""

import copy

import torch
from diffusers.models.transformers.transformer_2d_dreamlite import DreamLiteTransformer2DModel
from diffusers.models.unets.unet_dreamlite import DreamLiteUNetModel
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery

# diffusers' DreamLite pipeline tests' UNet (tests/pipelines/dreamlite/test_pipeline_dreamlite.py): 8 heads per block
# over 16, 32 and 64 channels, one key/value head, the first two down blocks and one up block without self-attention
UNET = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32, 64), cross_attention_dim=16,
            attention_head_dim=8, layers_per_block=1, norm_num_groups=8, transformer_layers_per_block=1)


def unet_inputs(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[:, -2:] = 0
    return dict(sample=torch.randn(2, 4, 8, 8, generator=generator), timestep=torch.tensor([10, 500]),
                encoder_hidden_states=torch.randn(2, 6, 16, generator=generator), encoder_attention_mask=mask)


def sharded_transformers(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    stock = DreamLiteUNetModel(**UNET).eval()
    kw = unet_inputs(1)
    family = W.families()["dreamlite"]
    mesh = init_device_mesh("cpu", (world,))
    model = copy.deepcopy(stock)
    transformers = [m for m in model.modules() if type(m) is DreamLiteTransformer2DModel]
    expected_all_reduces = 0
    for transformer in transformers:  # the UNet is no family: each of its transformers is one, sharded where it sits
        config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
        expected_all_reduces += family.tp.all_reduces(config)
        surgery.tensor_parallel(surgery.unfuse(transformer), mesh)
    out = {"transformers": len(transformers), "expected_all_reduces": expected_all_reduces}
    with torch.no_grad():
        expected = stock(**kw).sample
        with W.CollectiveCounter() as counter:
            out["forward"] = W.rel_err(model(**kw).sample, expected)
    out["collectives"] = dict(counter.counts)
    return out
