"""whole_unit.py on one rank (a world of one, as FSDP would run it): the gathered parameters keep their addresses
from step to step (what lets CUDA graphs replay) and follow every optimizer step; LocalAdamW steps exactly as
torch's AdamW on a plain model, through a reload of its state. The multi-rank numbers (uneven shards, hybrid
meshes, accumulation, activation checkpoints) are test_parallelize.py's, against the single-process reference."""
import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from minimal_fsdp.config import Config
from minimal_fsdp.model import GPT, GPTConfig
from minimal_fsdp.parallelize import WholeUnitSync, build_model, gradient_sync, make_plan
from minimal_fsdp.train import build_optimizer, train_step
from minimal_fsdp import whole_unit
from minimal_fsdp.whole_unit import LocalAdamW, WholeUnit

CONFIG = GPTConfig(vocab_size=64, seq_length=16, num_layers=2, num_heads=2, embed_size=16)
ENV = SimpleNamespace(device=torch.device("cpu"), world_size=1, local_world_size=1)


def batches(steps):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 17), generator=generator) for _ in range(steps)]


def unit_model(cfg):
    plan = make_plan(cfg, ENV, fsdp_on_one_rank=True)
    assert plan.gathered_whole(1000)
    return build_model(GPT, CONFIG, plan, ENV, cfg.seed), plan


def test_gathered_parameters_keep_their_addresses_and_follow_the_shards(one_rank_group):
    cfg = Config(sharding="full-shard")
    model, plan = unit_model(cfg)
    assert isinstance(model.whole_unit, WholeUnit)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    seen = []  # at each forward, after the unit's own hook: the weight the block computes with
    model.register_forward_pre_hook(lambda module, args: seen.append(module.blocks[0].attn.qkv.weight))
    optimizer, sync = build_optimizer(model, cfg), gradient_sync(model, plan)
    assert isinstance(optimizer, LocalAdamW) and isinstance(sync, WholeUnitSync)
    shards = []
    for tokens in batches(3):
        train_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], sync, 1.0, ENV.device)
        assert all(isinstance(p, DTensor) for p in model.parameters())  # sharded again after the step
        shards.append(model.blocks[0].attn.qkv.weight.full_tensor().clone())
    assert not any(isinstance(w, DTensor) for w in seen)
    assert len({w.data_ptr() for w in seen}) == 1  # one address, every step
    with torch.no_grad():
        model(batches(1)[0][:, :-1])  # gathers the last step's update
    assert torch.equal(seen[-1], shards[-1]) and not torch.equal(shards[-1], shards[-2])


def test_local_adamw_steps_as_torch_adamw(one_rank_group, monkeypatch):
    """Weights and AdamW state bit for bit a plain model's under torch.optim.AdamW, and AdamW's own step runs only
    where state is created (the first step; after a load the local lists are rebuilt, not the state). Without
    clipping: the two grad norms sum in different orders, and Adam's normalization magnifies the last bit."""
    own_steps = []
    step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: (own_steps.append(type(self)), step(self, *a))[1])
    cfg = Config(sharding="full-shard", weight_decay=0.1)
    model, plan = unit_model(cfg)
    plain = build_model(GPT, CONFIG, make_plan(cfg, ENV), ENV, cfg.seed)
    optimizers = [build_optimizer(model, cfg), build_optimizer(plain, cfg)]
    syncs = [gradient_sync(model, plan), gradient_sync(plain, make_plan(cfg, ENV))]
    for i, tokens in enumerate(batches(6)):
        if i == 3:  # as a resume does: the state is replaced by a copy of itself
            optimizers[0].load_state_dict(copy.deepcopy(optimizers[0].state_dict()))
        for m, optimizer, sync in zip((model, plain), optimizers, syncs):
            train_step(m, optimizer, [(tokens[:, :-1], tokens[:, 1:])], sync, 0.0, ENV.device)
    assert own_steps.count(LocalAdamW) == 1 and own_steps.count(torch.optim.AdamW) == 6
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    state = optimizers[0].state_dict()["state"]  # the optimizer's own tensors, as checkpoints read them
    ordered = [p for group in optimizers[1].param_groups for p in group["params"]]  # the same order
    assert len(state) == len(ordered)
    for index, q in enumerate(ordered):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key].full_tensor(), optimizers[1].state[q][key]), (index, key)


def test_no_shard_replicas_train_as_the_plain_model_without_gathering(one_rank_group, monkeypatch):
    """no-shard's unit (a shard group of one rank per replica; here one replica) casts its fp32 weights into the
    gathered ones and takes its gradients as they are: no all-gather, no reduce-scatter, and weights bit for bit
    the plain model's under AdamW, micro-steps accumulated (clip 0: the norms sum in different orders)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective over a shard group of one rank")
    monkeypatch.setattr(whole_unit, "all_gather", refuse)
    monkeypatch.setattr(whole_unit, "reduce_scatter", refuse)
    cfg = Config(sharding="no-shard", precision="float32", weight_decay=0.1, grad_accum_steps=2)
    two = SimpleNamespace(device=ENV.device, world_size=2, local_world_size=2)  # plans no-shard's replicas
    plan = dataclasses.replace(make_plan(cfg, two), mesh_shape=(1, 1))  # ... in this world of one
    assert plan.ddp and plan.gathered_whole(1000)
    model = build_model(GPT, CONFIG, plan, ENV, cfg.seed)
    plain = build_model(GPT, CONFIG, make_plan(cfg, ENV), ENV, cfg.seed)
    assert model.whole_unit.ranks == 1 and model.whole_unit.replicate_group is not None
    optimizers = [build_optimizer(model, cfg), build_optimizer(plain, cfg)]
    syncs = [gradient_sync(model, plan), gradient_sync(plain, make_plan(cfg, ENV))]
    assert isinstance(syncs[0], WholeUnitSync) and isinstance(optimizers[0], LocalAdamW)
    data = batches(6)
    for step in range(3):
        micro = [(t[:, :-1], t[:, 1:]) for t in data[2 * step:2 * step + 2]]
        for m, optimizer, sync in zip((model, plain), optimizers, syncs):
            train_step(m, optimizer, micro, sync, 0.0, ENV.device)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q), name


@pytest.mark.parametrize("flags,gathered", [([], True), (["--fsdp_unit", "block"], False),
                                            (["--cpu_offload"], False)])
def test_the_whole_unit_replaces_fsdp_where_the_model_is_one_unit(one_rank_group, flags, gathered):
    """By --fsdp_unit's rule, without offloading (FSDP2's): the tiny model is one unit."""
    from minimal_fsdp.config import parse_args
    from torch.distributed.fsdp import FSDPModule
    cfg = parse_args(["--sharding", "full-shard", *flags])
    plan = make_plan(cfg, ENV, fsdp_on_one_rank=True)
    model = build_model(GPT, CONFIG, plan, ENV, cfg.seed)
    assert hasattr(model, "whole_unit") == gathered and isinstance(model, FSDPModule) == (not gathered)
    assert ("one all-gather a step" in plan.describe(model.num_params(non_embedding=False))) == gathered
