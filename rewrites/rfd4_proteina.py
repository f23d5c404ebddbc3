"""`RFD4ProteinaTransformer` (diffusers `transformer_rfd4_proteina.py`): the `rfd4-proteina` family, RFdiffusion4's
protein velocity denoiser (a token trunk of pair-biased attention and SwiGLU transitions, a pair stack updated
between trunk layers).

- The attention's processor views q/k/v/gate by `attn.heads` x `attn.head_width` and reshapes back to the input's
  width: no head-dim twin fits it, so it runs unmodified on DTensor q/k/v (`surgery.parallel.dtensor_attention`).
  Its q/k norms are `torch.nn.RMSNorm`s over the whole width (heads x head width): `surgery.unfuse` computes them
  elementwise (`ElementwiseRMSNorm`), so a rank's share of the heads normalizes by one all-reduce of the statistic.
  Its pair bias (`to_bias`, pair width -> one logit per head) splits by heads like q.
- The transitions' `swish_linear` (a Linear in a Sequential) holds the SwiGLU's value and gate rows fused
  (`chunk(2)`): a `rows` leaf splits them, planned colwise, `linear_out` rowwise.
- Whole on every rank, declared below with their reasons: the output gates of the conditioning, and the pair
  stack (no heads; its triangle multiplications contract over the token pairs).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
from diffusers.models.transformers import transformer_rfd4_proteina as rfd
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.norms import elementwise_norm
from surgery.extend import TensorParallel, Tests, derived_family, rows, swap_rewrite
from surgery_rewrites.diffusers_common import cast_inputs


def _value_gate(m) -> list[tuple[str, int]]:
    half = m.linear_out.in_features
    return [("value", half), ("gate", half)]


REWRITES = (
    # processors and classes stay; only the norms' class changes: a checkpoint is the same in both layouts
    replace(swap_rewrite("rfd4_proteina.pair_attention: q/k norms across heads", rfd.RFD4ProteinaPairAttention,
                         children={"norm_q": elementwise_norm, "norm_k": elementwise_norm}), in_checkpoints=False),
    swap_rewrite("rfd4_proteina.transition", rfd.RFD4ProteinaTransition, leaves=(rows("swish_linear.0", _value_gate),)),
)

TRANSITION_PLAN = {"swish_linear.0.value": ColwiseParallel(), "swish_linear.0.gate": ColwiseParallel(),
                   "linear_out": RowwiseParallel()}

GATE = ("the sigmoid output gate of the replicated conditioning, multiplied into the whole-width residual update")
PAIRS = ("the pair stack: a [tokens x tokens x pair width] representation with no heads, whose triangle "
         "multiplications contract over the token pairs; whole on every rank")


def rfd4_proteina_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `RFD4ProteinaTransformer.forward`: `text_tokens` residues (the last one
    padding) with noisy backbone coordinates and local latents, their two times, and the conditioning the
    configured features read (no in-context conditioning; every token carries a local latent). `image_tokens` is
    not used: a protein has no image."""
    generator = torch.Generator().manual_seed(seed)
    tokens = text_tokens
    mask = torch.ones(batch, tokens, dtype=torch.bool)
    mask[:, -1] = False
    inputs = dict(
        bb_ca=torch.randn(batch, tokens, 3, generator=generator),
        local_latents=torch.randn(batch, tokens, config.get("latent_dim", 32), generator=generator),
        bb_ca_time=torch.rand(batch, generator=generator), local_latents_time=torch.rand(batch, generator=generator),
    )
    conditioning = {"is_in_context_conditioning": torch.zeros(batch, tokens, dtype=torch.bool),
                    "supports_local_latent": torch.ones(batch, tokens, dtype=torch.bool)}
    topology = released_features(config, batch, tokens, torch.Generator().manual_seed(seed + 1))
    extra = {k: topology.pop(k) for k in ("token_type", "atom37_mask") if k in topology}
    conditioning = {k: v.to(device) for k, v in {**conditioning, **topology}.items()}
    return {**cast_inputs(inputs, dtype, device), "padding_mask": mask.to(device),
            **{k: v.to(device) for k, v in extra.items()}, "conditioning": conditioning}


def released_features(config: dict, batch: int, tokens: int, generator: torch.Generator) -> dict:
    """The prepared tensors that the features `config` configures read and cannot do without (the class's defaults,
    the released checkpoint's lists: its token types, the atom37 mask and the atom-level interaction annotations
    (`KeyError` when absent), the bond path lengths, molecule and entity ids, index groups), seeded; none for
    features that read nothing absent (the tiny config's). Drawn from their own `generator`, after the inputs every
    config takes."""
    defaults = {k: p.default for k, p in inspect.signature(rfd.RFD4ProteinaTransformer.__init__).parameters.items()}
    names = {n for key in ("feats_seq", "feats_cond_seq", "feats_pair_repr", "feats_pair_cond")
             for n in config.get(key, defaults[key])}
    atoms = (batch, tokens, 37)
    out = {}
    if names & {"token_type", "atom_charge", "atomic_element"}:
        out["token_type"] = torch.randint(config.get("num_token_types", 7), (batch, tokens), generator=generator)
    interactions = {"hbond_modernized": ("hbond", 4), "pication": ("pication", 4), "pistack": ("pistack", 2),
                    "saltbridge": ("saltbridge", 2), "hydrophobic": ("hydrophobic", 2),
                    "metal_coord": ("metal_coord", 2)}
    if names & {*interactions, "rasa_binned", "hotspot"}:
        out["atom37_mask"] = torch.rand(atoms, generator=generator) < 0.5
    for feature, (key, values) in interactions.items():
        if feature in names:
            out[rfd.CONDITION_KEYS[key]] = torch.randint(values, atoms, generator=generator)
    if "token_bond_path_length" in names:
        index = torch.arange(tokens)
        out["token_bond_path_length"] = (index[:, None] - index[None, :]).abs().expand(batch, tokens, tokens)
    for feature, key in (("molecule_idx_pair", "molecule_iid"), ("molecule_entity_pair", "molecule_entity_id"),
                         ("index_group_pair", rfd.CONDITION_KEYS["index_group"])):
        if feature in names:
            out[key] = torch.randint(2, (batch, tokens), generator=generator)
    return out


FAMILY = derived_family(
    "rfd4-proteina", rfd.RFD4ProteinaTransformer, rewrites=REWRITES,
    variants={"rfd4": {}},
    sources="diffusers 0.42.1 RFD4ProteinaTransformer: its defaults (14 trunk layers, 768 wide = 12 heads of 64, "
    "384-wide pairs, the released feature lists), the class docstring's released checkpoint",
    default_variant="rfd4",
    example_inputs=rfd4_proteina_inputs,
    tp=TensorParallel(
        plans={rfd.RFD4ProteinaTransition: TRANSITION_PLAN},
        replicated={rfd.RFD4ProteinaAdaptiveAttention: {"scale_output.*": GATE},
                    rfd.RFD4ProteinaAdaptiveTransition: {"scale_output.*": GATE},
                    rfd.RFD4ProteinaPairUpdate: {"*": PAIRS}},
    ),
    tests=Tests(
        # diffusers 0.42.1 ships no RFD4-Proteina model test: the architecture at tiny widths, 4 heads of 8 (a mesh
        # of 4 splits them), two trunk layers and one pair update, the features a sampler's first step reads
        configs={"tiny": dict(nlayers=2, token_dim=32, nheads=4, dim_cond=16, pair_repr_dim=8, tri_mult_c=8,
                              t_emb_dim=16, seq_sep_dim=8, xt_pair_dist_dim=6, latent_dim=4, token_type_emb_dim=4,
                              cath_emb_dim=4, num_sequence_classes=5, feats_seq=("xt_bb_ca", "xt_local_latents"),
                              feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents"),
                              feats_pair_repr=("xt_bb_ca_pair_dists",), feats_pair_cond=("time_emb_bb_ca",))},
    ),
)
