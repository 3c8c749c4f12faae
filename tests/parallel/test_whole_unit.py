"""whole_unit.py on one rank (a world of one, as FSDP would run it): the gathered parameters keep
their addresses from step to step (what lets CUDA graphs replay) and follow every optimizer step;
LocalAdamW steps exactly as torch's AdamW on a plain model, through a reload of its state. The
multi-rank numbers (uneven shards, hybrid meshes, accumulation, activation checkpoints) are
test_parallelize.py's, against the single-process reference."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from minimal_fsdp.config.flags import Config
from minimal_fsdp.config.sections import Optimizer
from minimal_fsdp.models.gpt import GPT, GPTConfig
from minimal_fsdp.parallel import plan as plan_module
from minimal_fsdp.parallel import whole_unit
from minimal_fsdp.parallel.parallelize import WholeUnitSync, build_model, gradient_sync
from minimal_fsdp.parallel.plan import make_plan
from minimal_fsdp.parallel.whole_unit import LocalAdamW, WholeUnit
from minimal_fsdp.train import build_optimizer, train_step

CONFIG = GPTConfig(vocab_size=64, seq_length=16, num_layers=2, num_heads=2, embed_size=16)
ENV = SimpleNamespace(device=torch.device("cpu"), world_size=1, local_world_size=1, num_nodes=1)


def batches(steps):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 17), generator=generator) for _ in range(steps)]


def unit_model(cfg):
    plan = make_plan(cfg, ENV, CONFIG, fsdp_on_one_rank=True)
    assert plan.strategy == "one-unit"
    return build_model(GPT, CONFIG, plan, ENV, cfg.seed), plan


def test_gathered_parameters_keep_their_addresses_and_follow_the_shards(one_rank_group):
    cfg = Config(sharding="full-shard")
    model, plan = unit_model(cfg)
    assert isinstance(model.whole_unit, WholeUnit)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    seen = []  # at each forward, after the unit's own hook: the weight the block computes with
    model.register_forward_pre_hook(
        lambda module, args: seen.append(module.blocks[0].attn.qkv.weight)
    )
    optimizer, sync = build_optimizer(model, Optimizer.of(cfg), plan), gradient_sync(model, plan)
    assert isinstance(optimizer, LocalAdamW) and isinstance(sync, WholeUnitSync)
    shards = []
    for tokens in batches(3):
        train_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], sync, 1.0, ENV.device)
        # sharded again after the step
        assert all(isinstance(p, DTensor) for p in model.parameters())
        shards.append(model.blocks[0].attn.qkv.weight.full_tensor().clone())
    assert not any(isinstance(w, DTensor) for w in seen)
    assert len({w.data_ptr() for w in seen}) == 1  # one address, every step
    with torch.no_grad():
        model(batches(1)[0][:, :-1])  # gathers the last step's update
    assert torch.equal(seen[-1], shards[-1]) and not torch.equal(shards[-1], shards[-2])


def test_local_adamw_steps_as_torch_adamw(one_rank_group, monkeypatch):
    """Weights and AdamW state bit for bit a plain model's under torch.optim.AdamW, and AdamW's own
    step runs only where state is created (the first step; after a load the local lists are rebuilt,
    not the state). Without clipping: the two grad norms sum in different orders, and Adam's
    normalization magnifies the last bit."""
    own_steps = []
    step = torch.optim.AdamW.step
    monkeypatch.setattr(
        torch.optim.AdamW,
        "step",
        lambda self, *a: (own_steps.append(type(self)), step(self, *a))[1],
    )
    cfg = Config(sharding="full-shard", weight_decay=0.1)
    model, plan = unit_model(cfg)
    plain_plan = make_plan(cfg, ENV, CONFIG)
    plain = build_model(GPT, CONFIG, plain_plan, ENV, cfg.seed)
    optimizers = [
        build_optimizer(model, Optimizer.of(cfg), plan),
        build_optimizer(plain, Optimizer.of(cfg), plain_plan),
    ]
    syncs = [gradient_sync(model, plan), gradient_sync(plain, plain_plan)]
    for i, tokens in enumerate(batches(6)):
        if i == 3:  # as a resume does: the state is replaced by a copy of itself
            optimizers[0].load_state_dict(copy.deepcopy(optimizers[0].state_dict()))
        for m, optimizer, sync in zip((model, plain), optimizers, syncs):
            train_step(m, optimizer, [(tokens[:, :-1], tokens[:, 1:])], sync, 0.0, ENV.device)
    assert own_steps.count(LocalAdamW) == 1 and own_steps.count(torch.optim.AdamW) == 6
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    # the optimizer's own tensors, as checkpoints read them
    state = optimizers[0].state_dict()["state"]
    ordered = [p for group in optimizers[1].param_groups for p in group["params"]]  # the same order
    assert len(state) == len(ordered)
    for index, q in enumerate(ordered):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key].full_tensor(), optimizers[1].state[q][key]), (
                index,
                key,
            )


def test_no_shard_replicas_train_as_the_plain_model_without_gathering(one_rank_group, monkeypatch):
    """no-shard's unit (a shard group of one rank per replica; here one replica) casts its fp32
    weights into the gathered ones and takes its gradients as they are: no all-gather, no
    reduce-scatter, and weights bit for bit the plain model's under AdamW, micro-steps accumulated
    (clip 0: the norms sum in different orders)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a collective over a shard group of one rank")

    monkeypatch.setattr(whole_unit, "all_gather", refuse)
    monkeypatch.setattr(whole_unit, "reduce_scatter", refuse)
    cfg = Config(sharding="no-shard", precision="float32", weight_decay=0.1, grad_accum_steps=2)
    # plans no-shard's replicas
    two = SimpleNamespace(device=ENV.device, world_size=2, local_world_size=2, num_nodes=1)
    build_mesh = plan_module.init_device_mesh  # ... on a (1 x 1) mesh in this world of one
    monkeypatch.setattr(
        plan_module,
        "init_device_mesh",
        lambda kind, shape, mesh_dim_names: build_mesh(kind, (1, 1), mesh_dim_names=mesh_dim_names),
    )
    plan = dataclasses.replace(make_plan(cfg, two, CONFIG), mesh_shape=(1, 1))
    assert plan.strategy == "one-unit" and plan.sharding == "no-shard"
    model = build_model(GPT, CONFIG, plan, ENV, cfg.seed)
    plain_plan = make_plan(cfg, ENV, CONFIG)
    plain = build_model(GPT, CONFIG, plain_plan, ENV, cfg.seed)
    assert model.whole_unit.ranks == 1 and model.whole_unit.replicate_group is not None
    optimizers = [
        build_optimizer(model, Optimizer.of(cfg), plan),
        build_optimizer(plain, Optimizer.of(cfg), plain_plan),
    ]
    syncs = [gradient_sync(model, plan), gradient_sync(plain, plain_plan)]
    assert isinstance(syncs[0], WholeUnitSync) and isinstance(optimizers[0], LocalAdamW)
    data = batches(6)
    for step in range(3):
        micro = [(t[:, :-1], t[:, 1:]) for t in data[2 * step : 2 * step + 2]]
        for m, optimizer, sync in zip((model, plain), optimizers, syncs):
            train_step(m, optimizer, micro, sync, 0.0, ENV.device)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q), name


@pytest.mark.parametrize(
    "flags,gathered", [([], True), (["--fsdp_unit", "block"], False), (["--cpu_offload"], False)]
)
def test_the_whole_unit_replaces_fsdp_where_the_model_is_one_unit(one_rank_group, flags, gathered):
    """By --fsdp_unit's rule, without offloading (FSDP2's): the tiny model is one unit."""
    from torch.distributed.fsdp import FSDPModule

    from minimal_fsdp.config.flags import parse_args

    cfg = parse_args(["--sharding", "full-shard", *flags])
    plan = make_plan(cfg, ENV, CONFIG, fsdp_on_one_rank=True)
    assert (plan.strategy == "one-unit") == gathered
    model = build_model(GPT, CONFIG, plan, ENV, cfg.seed)
    assert hasattr(model, "whole_unit") == gathered and isinstance(model, FSDPModule) == (
        not gathered
    )
    assert ("one all-gather a step" in plan.describe()) == gathered


def gathered_weight(model, tokens):
    """The first block's qkv weight as a forward computes with it (after the unit's gather)."""
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(
        lambda block, args: seen.append(block.attn.qkv.weight.clone())
    )
    with torch.no_grad():
        model(tokens)
    hook.remove()
    return seen[0]


def test_any_optimizer_step_and_any_load_reach_the_next_forward(one_rank_group):
    """The gathered weights follow the shards with nobody telling the unit: after a torch AdamW
    built here and stepped outside train_step, and after a load of other weights."""
    from torch.distributed.device_mesh import init_device_mesh

    model = GPT(CONFIG)
    unit = WholeUnit(
        model, init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)), torch.float32, ENV.device
    )
    weight = model.blocks[0].attn.qkv.weight  # sharded (a DTensor) outside forward and backward
    tokens = batches(1)[0]
    assert torch.equal(gathered_weight(model, tokens[:, :-1]), weight.full_tensor())
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    unit.reduce()
    torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()
    assert torch.equal(gathered_weight(model, tokens[:, :-1]), weight.full_tensor())
    # one rank: shard = whole
    state = {name: value.full_tensor() + 1 for name, value in model.state_dict().items()}
    model.load_state_dict(
        {
            name: DTensor.from_local(value, weight.device_mesh, weight.placements)
            for name, value in state.items()
        }
    )
    assert torch.equal(gathered_weight(model, tokens[:, :-1]), state["blocks.0.attn.qkv.weight"])


def _module_parameters_swap():
    layer = torch.nn.Linear(2, 3)
    other = torch.nn.Parameter(torch.zeros(3, 2))
    layer._parameters["weight"] = other
    assert layer.weight is other and dict(layer.named_parameters())["weight"] is other
    assert torch.equal(layer(torch.ones(1, 2)), layer.bias.detach().unsqueeze(0).expand(1, 3))


def _chunk_cat():
    # FSDP2's layout: each tensor split into num_chunks along dim 0 (torch.chunk's sizes), padded
    # with zeros to ceil(rows / num_chunks) rows, chunk i of every tensor side by side in row i.
    a, b = torch.arange(3.0).view(3, 1), torch.arange(10.0, 14.0).view(2, 2)
    out = torch.empty(2, 2 * 1 + 1 * 2)
    torch._chunk_cat([a, b], dim=0, num_chunks=2, out=out)
    assert out.tolist() == [[0.0, 1.0, 10.0, 11.0], [2.0, 0.0, 12.0, 13.0]]


def _dtensor_local_tensor(mesh):
    local = torch.arange(4.0)
    dtensor = DTensor.from_local(
        local, mesh, (whole_unit.Shard(0),), run_check=False, shape=(4,), stride=(1,)
    )
    assert isinstance(dtensor._local_tensor, torch.Tensor) and not isinstance(
        dtensor._local_tensor, DTensor
    )
    assert dtensor._local_tensor.data_ptr() == local.data_ptr() == dtensor.to_local().data_ptr()


def _functional_adamw():
    import inspect

    names = set(inspect.signature(whole_unit.adamw).parameters)
    assert {
        "fused",
        "amsgrad",
        "beta1",
        "beta2",
        "lr",
        "weight_decay",
        "eps",
        "maximize",
    } <= names, names
    params = [torch.nn.Parameter(torch.tensor([1.0, -2.0])) for _ in range(2)]
    for p in params:
        p.grad = torch.tensor([0.5, 0.25])
    reference = torch.optim.AdamW(params[:1], lr=0.1, weight_decay=0.1, fused=True)
    # creates the state, then steps; the functional call below steps params[1] the same way
    reference.step()
    state = {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2), "step": torch.tensor(0.0)}
    with torch.no_grad():
        whole_unit.adamw(
            [params[1]],
            [params[1].grad],
            [state["exp_avg"]],
            [state["exp_avg_sq"]],
            [],
            [state["step"]],
            fused=True,
            amsgrad=False,
            beta1=0.9,
            beta2=0.999,
            lr=0.1,
            weight_decay=0.1,
            eps=1e-8,
            maximize=False,
        )
    assert torch.equal(params[0], params[1])


def _optimizer_step_post_hook():
    seen = []
    handle = whole_unit.register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: seen.append(optimizer)
    )
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    optimizer = torch.optim.SGD([param], lr=1.0)
    optimizer.step()
    handle.remove()
    optimizer.step()
    assert seen == [optimizer]


def _collective_names():
    assert callable(whole_unit.all_gather) and callable(whole_unit.reduce_scatter)


PRIVATE_APIS = {
    "nn.Module._parameters (swapped by whole_unit.install)": _module_parameters_swap,
    "torch._chunk_cat (WholeUnit.accumulate)": _chunk_cat,
    "DTensor._local_tensor and DTensor.from_local(shape=, stride=)": _dtensor_local_tensor,
    "torch.optim.adamw.adamw, the functional AdamW (LocalAdamW.step)": _functional_adamw,
    "torch.optim.optimizer.register_optimizer_step_post_hook (the unit's "
    "refresh)": _optimizer_step_post_hook,
    "dist.all_gather_single / all_gather_into_tensor, reduce_scatter_single / "
    "reduce_scatter_tensor": _collective_names,
}


@pytest.mark.parametrize("api", PRIVATE_APIS)
def test_the_torch_internals_the_unit_relies_on_still_behave(one_rank_group, api):
    """A canary: whole_unit.py uses parts of PyTorch that are private or young. If one changes
    signature, meaning or disappears in a new torch, this fails naming it, before any training run
    computes with it."""
    from torch.distributed.device_mesh import init_device_mesh

    check = PRIVATE_APIS[api]
    try:
        check(
            init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        ) if check is _dtensor_local_tensor else check()
    except Exception as e:  # AssertionError included: a changed meaning
        pytest.fail(
            f"torch {torch.__version__} changed {api}, which whole_unit.py relies on: "
            f"{type(e).__name__}: {e}",
            pytrace=False,
        )
