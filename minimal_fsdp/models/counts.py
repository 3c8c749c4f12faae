"""How many parameters a model has, counted from its shape without building it: what `minimal-fsdp
plan` uses, so it answers without importing torch. models/size.py counts the same from one block
built on the meta device (the training code's counter); tests/tools/test_plan_command.py holds the
two equal for every preset and for shapes drawn at random."""

import dataclasses
from dataclasses import field


@dataclasses.dataclass(frozen=True)
class Sizes:
    total: int  # every parameter, embeddings included, counted once (tied weights too)
    per_block: int
    # everything outside the blocks: embeddings, final norm, output head (FSDP's root unit)
    root: int
    lookup: int = 0  # the embedding that is only looked up (no FLOPs; layers.Decoder.lookup_only)
    # (name in the block, in features, out features) of each linear layer of a block
    block_linears: tuple = ()
    # (rows, cols) of each matrix outside the blocks (embeddings, an untied output head)
    root_matrices: tuple = field(default=(), compare=False)  # models/size.py does not count them


def count(config):
    """Sizes of a family's config, as models/size.count_parameters counts them: each family says
    its own terms (models/families/<family>.py, `sizes`)."""
    from minimal_fsdp.models.families import FAMILIES  # the families import Sizes' module

    per_block, root, lookup, linears, matrices = FAMILIES[config.model_type].sizes(config)
    total = root + per_block * config.num_layers
    return Sizes(total, per_block, root, lookup, linears, matrices)


def parameter_shapes(config):
    """The shapes of the model's matrices (each block's linears, the embeddings and head) and one
    vector holding every other parameter: what PowerSGD's cost depends on (it compresses matrices
    and sends vectors whole), without building the model."""
    sizes = count(config)
    shapes = [(o, i) for _, i, o in sizes.block_linears] * config.num_layers
    shapes += list(sizes.root_matrices)
    rest = sizes.total - sum(r * c for r, c in shapes)
    return shapes + ([(rest,)] if rest else [])
