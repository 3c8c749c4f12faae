"""Run under `mpiexec -n 4` by test_parallelize.py (gloo), `-n 2` by test_gpu.py (NCCL): the
gradients every strategy leaves after one backward, with --reduce_precision float32 and bf16, and
each rank's own gradient.

For each case (a sharding and the flags that pick its strategy), builds the model as training does,
runs one forward and backward on this rank's own batch, synchronizes as train_step does, and records
every parameter's whole gradient (a DTensor's gathered). With float32, also the rank's own gradient:
a plain, unsharded fp32 copy of the model's initial weights, one forward and backward on the same
batch, no process group involved (what the reduced gradient must be the mean of). Every rank writes
rank_<r>.json into the directory argv[1].
"""

import json
import sys
from pathlib import Path

import torch
from sharding_ranks import CONFIG
from torch.distributed.tensor import DTensor

from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.launch import environment
from minimal_fsdp.models.gpt import GPT
from minimal_fsdp.parallel.parallelize import build_model, gradient_sync
from minimal_fsdp.parallel.plan import make_plan

# name -> the flags; each case's strategy is checked by the test (plan.strategy)
CASES = {
    "full-shard": ["--sharding", "full-shard", "--fsdp_unit", "block"],
    "grad-shard": ["--sharding", "grad-shard", "--fsdp_unit", "block"],
    "hybrid-full-shard": [
        "--sharding",
        "hybrid-full-shard",
        "--shard_group_size",
        "2",
        "--fsdp_unit",
        "block",
    ],
    "full-shard-bf16": ["--sharding", "full-shard", "--fsdp_unit", "block", "--precision", "bf16"],
    "one-unit": ["--sharding", "full-shard"],
    "one-unit-hybrid": ["--sharding", "hybrid-full-shard", "--shard_group_size", "2"],
    "one-unit-no-shard": ["--sharding", "no-shard"],
    "ddp": ["--sharding", "no-shard", "--fsdp_unit", "block"],
}


def whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def own_gradient(model, tokens):
    """This rank's gradient of its own batch on a plain fp32 copy of `model`'s weights: nothing
    reduced."""
    plain = GPT(CONFIG)
    plain.load_state_dict(
        {name: whole(p.detach()).float().cpu() for name, p in model.named_parameters()}
    )
    tokens = tokens.cpu()
    plain(tokens[:, :-1], tokens[:, 1:]).backward()
    return {name: p.grad.flatten().tolist() for name, p in plain.named_parameters()}


def gradients(env, flags, own=False):
    cfg = parse_args(flags)
    plan = make_plan(cfg, env, CONFIG)
    model = build_model(GPT, CONFIG, plan, env, cfg.seed)
    sync = gradient_sync(model, plan)
    tokens = torch.randint(
        CONFIG.vocab_size,
        (2, CONFIG.seq_length + 1),
        # each rank its own
        generator=torch.Generator().manual_seed(env.rank),
    ).to(env.device)
    mine = own_gradient(model, tokens) if own else None  # before the backward: the same weights
    sync.start(0)
    sync.micro_step(last=True)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    sync.finish()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name] = grad.float().flatten().tolist()
    return {"strategy": plan.strategy, "grads": grads, **({"own": mine} if own else {})}


def main():
    env = environment.setup(parse_args(["--collective_timeout", "120"]))
    torch.set_num_threads(1)
    result = {
        name: {
            reduce: gradients(env, [*flags, "--reduce_precision", reduce], own=reduce == "float32")
            for reduce in ("float32", "bf16")
        }
        for name, flags in CASES.items()
    }
    (Path(sys.argv[1]) / f"rank_{env.rank}.json").write_text(json.dumps(result))
    environment.teardown()


if __name__ == "__main__":
    main()
