"""How many parameters a model has, counted from its shape without building it: what `minimal-fsdp
plan` uses, so it answers without importing torch. models/size.py counts the same from one block
built on the meta device (the training code's counter); tests/models/test_counts.py holds the two
equal for every preset and for shapes drawn at random."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sizes:
    total: int  # every parameter, embeddings included, counted once (tied weights too)
    per_block: int
    # everything outside the blocks: embeddings, final norm, output head (FSDP's root unit)
    root: int
    lookup: int = 0  # the embedding that is only looked up (no FLOPs; layers.Decoder.lookup_only)
    # (name in the block, in features, out features) of each linear layer of a block
    block_linears: tuple = ()


def count(config):
    """Sizes of a family's config, as models/size.count_parameters counts them: each family says
    its own terms (models/families/<family>.py, `sizes`)."""
    from minimal_fsdp.models.families import FAMILIES  # the families import Sizes' module

    per_block, root, lookup, linears = FAMILIES[config.model_type].sizes(config)
    return Sizes(root + per_block * config.num_layers, per_block, root, lookup, linears)
