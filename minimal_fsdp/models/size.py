"""How many parameters a model has, counted from one block built on the meta device (no memory,
exact numbers): the counter the plan (which strategy) and the startup check use. The memory planner
counts the same from the shape alone (counts.py), without torch."""

import dataclasses

import torch

from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.counts import Sizes


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
