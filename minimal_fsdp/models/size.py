"""How many parameters a model has, counted from one block built on the meta device (no memory,
exact numbers): the one counter that the plan (which strategy), the memory planner and the startup
check all use."""

import dataclasses

import torch

from minimal_fsdp.models.classes import MODELS


@dataclasses.dataclass(frozen=True)
class Sizes:
    total: int  # every parameter, embeddings included, counted once (tied weights too)
    per_block: int
    # everything outside the blocks: embeddings, final norm, output head (FSDP's root unit)
    root: int
    lookup: int = 0  # the embedding that is only looked up (no FLOPs; layers.Decoder.lookup_only)
    # (name in the block, in features, out features) of each linear layer of a block
    block_linears: tuple = ()


def count_parameters(model_config):
    with torch.device("meta"):  # one block is enough: the others are the same
        model = MODELS[model_config.model_type](dataclasses.replace(model_config, num_layers=1))
    block = model.blocks[0]
    per_block = sum(p.numel() for p in block.parameters())
    root = sum(p.numel() for p in model.parameters()) - per_block
    lookup = model.get_parameter(model.lookup_only).numel() if model.lookup_only else 0
    linears = tuple(
        (name, m.in_features, m.out_features)
        for name, m in block.named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    return Sizes(root + per_block * model_config.num_layers, per_block, root, lookup, linears)
