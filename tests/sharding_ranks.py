"""Run under `mpiexec -n 4` by test_parallelize.py: what FSDP actually holds on each rank.

For each sharding, builds the model as training does (plan.make_plan, parallelize.build_model) and
records the mesh (shape, dimension names, this rank's group along each dimension) and, for every
block's qkv weight, whether it is a sharded DTensor and its local shape after a training forward and
after backward (no-shard of units per block, which is DDP on a plain module: each rank's loss on its
own batch and its qkv gradient after backward), and whether the first block's parameters were
already gathered when its forward began (one unit). Then generates on a no-shard model whose weights
get different noise on every rank, so the ranks' logits differ: once as generate() does it, and once
with its token broadcast switched off (each rank's own choice). Every rank writes rank_<r>.json into
the directory argv[1].
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.inference import generate
from minimal_fsdp.launch import environment
from minimal_fsdp.models.gpt import GPT, GPTConfig
from minimal_fsdp.parallel.parallelize import build_model, gradient_sync
from minimal_fsdp.parallel.plan import make_plan

# 3 blocks (the last one never reshards); vocab 42 shards unevenly over 4 ranks (11, 11, 11,
# 9 rows).
CONFIG = GPTConfig(vocab_size=42, seq_length=16, num_layers=3, num_heads=2, embed_size=16)
# FSDP unit per block (as large models have it), and the whole model as one unit (small
# models' default)
SHARDINGS = {
    "full-shard": ["--fsdp_unit", "block"],
    "grad-shard": ["--fsdp_unit", "block"],
    # DDP; whole_unit.py's replicas
    "no-shard-block": ["--fsdp_unit", "block"],
    "no-shard-model": [],
    "hybrid-full-shard": ["--shard_group_size", "2", "--fsdp_unit", "block"],
    "hybrid-grad-shard": ["--shard_group_size", "2", "--fsdp_unit", "block"],
    "hybrid-full-shard-4": ["--shard_group_size", "4", "--fsdp_unit", "block"],
    "full-shard-model": ["--fsdp_unit", "model"],
    "grad-shard-model": [],
    "hybrid-full-shard-model": ["--shard_group_size", "2"],
}


def held(model):
    """Per block: (is a DTensor, local shape) of its qkv weight; and the embedding's local shape."""
    blocks = []
    for block in model.blocks:
        weight = block.attn.qkv.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        blocks.append([isinstance(weight, DTensor), list(local.shape)])
    wte = model.wte.weight
    return {
        "blocks": blocks,
        "wte": list((wte.to_local() if isinstance(wte, DTensor) else wte).shape),
    }


def sharding_state(env, name, extra):
    cfg = parse_args(
        [
            "--sharding",
            name.removesuffix("-4").removesuffix("-model").removesuffix("-block"),
            *extra,
        ]
    )
    plan = make_plan(cfg, env, CONFIG)
    model = build_model(GPT, CONFIG, plan, env, cfg.seed)
    if plan.strategy == "ddp":
        # each rank its own batch: DDP must leave every rank the average gradient
        tokens = torch.randint(
            CONFIG.vocab_size,
            (2, CONFIG.seq_length + 1),
            generator=torch.Generator().manual_seed(env.rank),
        )
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return {
            "mesh": None,
            "ddp": True,
            "loss": loss.item(),
            "after_backward": held(model),
            "grad": model.blocks[0].attn.qkv.weight.grad.flatten().tolist(),
            # of DDP's buckets
            "grads_are_views": all(p.grad._is_view() for p in model.parameters()),
        }
    mesh = model.wte.weight.device_mesh  # FSDP's, or the one no-shard's unit is built with
    # is the block gathered by then (by the root, as one unit)?
    model.blocks[0].register_forward_pre_hook(
        lambda module, args: gathered_at_block.append(
            not isinstance(module.attn.qkv.weight, DTensor)
        ),
        prepend=True,
    )  # before the block's own FSDP hook, if it has one
    gathered_at_block = []
    groups = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in mesh.mesh_dim_names}
    tokens = torch.randint(
        CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=torch.Generator().manual_seed(0)
    )
    # as train_step: the one unit reduces (and reshards) when backward is done
    sync = gradient_sync(model, plan)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    after_forward = held(model)
    loss.backward()
    sync.finish()
    return {
        "mesh": list(mesh.shape),
        "dims": list(mesh.mesh_dim_names),
        "groups": groups,
        "whole_model_unit": gathered_at_block == [True],
        "after_forward": after_forward,
        "after_backward": held(model),
    }


class Numbers:
    """A tokenizer of space-separated token ids."""

    eot_id = None

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


def generation_state(env):
    # the tiny model: whole_unit.py's unit on every rank
    cfg = parse_args(["--sharding", "no-shard"])
    model = build_model(GPT, CONFIG, make_plan(cfg, env, CONFIG), env, cfg.seed)
    noise = torch.Generator().manual_seed(100 + env.rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(torch.randn(local.shape, generator=noise))
    prompt, n = "1 2 3", 24
    text = generate.generate(model, Numbers(), prompt, n, temperature=1.0, top_k=0, seed=0)
    # each rank keeps its own token
    generate.dist = SimpleNamespace(broadcast=lambda tensor, src: None)
    try:
        own = generate.generate(model, Numbers(), prompt, n, temperature=1.0, top_k=0, seed=0)
    finally:
        generate.dist = dist
    return {"text": text, "own": own}


def main():
    env = environment.setup(parse_args(["--collective_timeout", "120"]))
    torch.set_num_threads(1)
    result = {
        "shardings": {name: sharding_state(env, name, extra) for name, extra in SHARDINGS.items()},
        "generation": generation_state(env),
    }
    (Path(sys.argv[1]) / f"rank_{env.rank}.json").write_text(json.dumps(result))
    environment.teardown()


if __name__ == "__main__":
    main()
