"""backends/default.py: the parts of a CUDA or CPU run that run.train_model wires (xla.py's are
tested in test_xla.py)."""

import dataclasses

import torch

from minimal_fsdp.backends import default
from minimal_fsdp.checkpoint import checkpointer
from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.config.sections import Backend, Checkpoint
from minimal_fsdp.launch.environment import DistEnv
from minimal_fsdp.models.gpt import GPT, GPTConfig
from minimal_fsdp.parallel.parallelize import LocalSync, init_weights
from minimal_fsdp.parallel.plan import make_plan

CONFIG = GPTConfig(vocab_size=16, seq_length=8, num_layers=2, num_heads=2, embed_size=8)


def test_torch_gives_the_plans_model_sync_and_checkpointer(monkeypatch, one_rank_group):
    """The model as parallelize.build_model lays it out for the plan (here one rank: a plain module
    with init_weights' values), the sync parallelize.gradient_sync picks for the plan (gossip's
    too), the data as it is, every rank one data-parallel member."""
    env = DistEnv(0, 1, 0, 1, 1, torch.device("cpu"), "gloo", "single")
    cfg = parse_args(["--seed", 7])
    plan = make_plan(cfg, env, CONFIG)
    flags = (Backend.of(cfg), Checkpoint.of(cfg), dataclasses.asdict(cfg))  # as backends.for_plan
    parts = default.Torch(*flags, env, plan)
    assert (plan.backend, parts.ranks, parts.local_ranks, parts.env) == ("torch", 1, 1, env)
    model = parts.build_model(CONFIG)
    reference = GPT(CONFIG)
    init_weights(reference, 7, "cpu")
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), reference.state_dict().values())
    )
    assert type(parts.gradient_sync(model)) is LocalSync
    data = object()
    assert parts.batches(data) is data
    # collective: the ranks agree on background saves
    saver = parts.checkpointer(CONFIG, None, model)
    assert (
        type(saver) is checkpointer.Checkpointer
        and not saver.decentralized
        and saver.mode == "sync"
    )
    made = []
    monkeypatch.setattr(
        default, "gradient_sync", lambda model, plan: made.append((model, plan)) or "sync"
    )
    gossip = dataclasses.replace(plan, strategy="gossip")
    assert default.Torch(*flags, env, gossip).gradient_sync(model) == "sync" and made == [
        (model, gossip)
    ]
