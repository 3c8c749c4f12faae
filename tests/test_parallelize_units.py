"""parallelize.py's decisions, in this process (fast, and what mutation testing can see): the layout of every
strategy, the plan make_plan builds from the flags and the launch, what the plan says of itself, what shard()
hands to FSDP2 (units, resharding, mixed precision, offload), what build_model compiles, and which gradient sync
a plan gets. The multi-rank behaviour they lead to is checked in test_parallelize.py."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from minimal_fsdp import parallelize
from minimal_fsdp.whole_unit import WholeUnit
from minimal_fsdp.config import ConfigError, parse_args
from minimal_fsdp.model import GPT, GPTConfig
from minimal_fsdp.parallelize import (SMALL_MODEL, DDPSync, FSDPSync, LocalSync, build_model, gradient_sync,
                                      WholeUnitSync, layout, make_plan, shard)

CONFIG = GPTConfig(vocab_size=64, seq_length=16, num_layers=3, num_heads=2, embed_size=16)


@pytest.mark.parametrize("sharding,world,group,expected", [
    ("full-shard", 4, 2, ((4,), 4, True)),
    ("full-shard", 2, 2, ((2,), 2, True)),
    ("grad-shard", 4, 2, ((4,), 4, False)),
    ("no-shard", 4, 2, ((4, 1), 1, False)),
    ("hybrid-full-shard", 8, 4, ((2, 4), 4, True)),
    ("hybrid-grad-shard", 8, 4, ((2, 4), 4, False)),
    ("hybrid-full-shard", 4, 1, ((4, 1), 1, False)),  # a shard group of one: nothing to reshard
    ("full-shard", 1, 1, ((1,), 1, False)),
])
def test_layout_of_every_strategy(sharding, world, group, expected):
    assert layout(sharding, world, group) == expected


def plan_for(monkeypatch, flags, world=1, local=None, device="cpu", **options):
    """make_plan on a pretend launch; the mesh make_plan asks for is recorded, not built."""
    meshes = []
    monkeypatch.setattr(parallelize, "init_device_mesh",
                        lambda kind, shape, mesh_dim_names: meshes.append((kind, shape, mesh_dim_names)) or "mesh")
    env = SimpleNamespace(device=torch.device(device), world_size=world, local_world_size=local or world)
    plan = make_plan(parse_args([str(f) for f in flags]), env, **options)
    return plan, meshes


def test_one_rank_is_a_plain_module(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--precision", "bf16", "--compile", "--activation_checkpoints",
                                          "--recompute", "selective", "--fsdp_unit", "block"])
    assert not plan.fsdp and not plan.ddp and not plan.decentralized and meshes == [] and plan.mesh is None
    assert (plan.mesh_shape, plan.shard_ranks, plan.reshard_after_forward) == ((1,), 1, False)
    assert (plan.precision, plan.compile, plan.activation_checkpoints, plan.recompute, plan.fsdp_unit) == \
        ("bf16", True, True, "selective", "block")
    assert not plan.meta_init and not plan.cpu_offload and plan.fp8 is None and not plan.cuda_graphs
    assert plan.describe(10) == "no FSDP: one rank holds the whole model"


def test_fsdp_over_ranks_asks_for_the_strategys_mesh(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--sharding", "full-shard"], world=4)
    assert plan.fsdp and not plan.ddp and plan.mesh == "mesh"
    assert meshes == [("cpu", (4,), ("shard",))]
    assert (plan.mesh_shape, plan.shard_ranks, plan.reshard_after_forward) == ((4,), 4, True)
    assert plan.describe(SMALL_MODEL + 1) == "mesh shard=4 (full-shard), an FSDP unit per block"
    assert plan.describe(SMALL_MODEL) == "mesh shard=4 (full-shard), the whole model as one unit, one all-gather a step"


def test_hybrid_shards_over_the_ranks_of_a_node_unless_told(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--sharding", "hybrid-grad-shard"], world=8, local=4)
    assert meshes == [("cpu", (2, 4), ("replicate", "shard"))] and plan.shard_ranks == 4
    assert not plan.reshard_after_forward and plan.stays_gathered
    assert plan.describe(1) == \
        "mesh replicate=2 x shard=4 (hybrid-grad-shard), the whole model as one unit, one all-gather a step"
    _, meshes = plan_for(monkeypatch, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2], world=8, local=4)
    assert meshes == [("cpu", (4, 2), ("replicate", "shard"))]


def test_no_shard_is_the_one_unit_or_ddp_unless_offloaded(monkeypatch):
    """no-shard over several ranks: a small model is whole_unit.py's unit on a (ranks x 1) mesh that build_model
    makes (a large one, or --fsdp_unit block, is DDP's: no mesh); float8 layers stay with DDP."""
    plan, meshes = plan_for(monkeypatch, ["--sharding", "no-shard"], world=2)
    assert plan.ddp and not plan.fsdp and meshes == [] and plan.shard_ranks == 1 and plan.mesh_shape == (2, 1)
    assert plan.gathered_whole(SMALL_MODEL) and not plan.gathered_whole(SMALL_MODEL + 1)
    assert not plan.whole_model_unit(SMALL_MODEL)  # FSDP's unit: none
    assert plan.describe(1) == "no sharding: the whole model on every rank as one unit, gradients averaged by one " \
        "all-reduce a step (no-shard)"
    assert plan.describe(SMALL_MODEL + 1) == \
        "no FSDP: the whole model on every rank, gradients all-reduced by DDP (no-shard)"
    plan, _ = plan_for(monkeypatch, ["--sharding", "no-shard", "--fsdp_unit", "block"], world=2)
    assert plan.ddp and not plan.gathered_whole(1)
    assert not dataclasses.replace(plan, fsdp_unit="auto", fp8="tensorwise").gathered_whole(1)
    plan, meshes = plan_for(monkeypatch, ["--sharding", "no-shard", "--cpu_offload"], world=2)
    assert plan.fsdp and not plan.ddp and plan.cpu_offload and meshes == [("cpu", (2, 1), ("replicate", "shard"))]
    plan, _ = plan_for(monkeypatch, ["--sharding", "no-shard"], world=1)
    assert not plan.ddp and not plan.fsdp  # one rank: nothing to average


def test_fsdp_on_one_rank_and_offload_on_one_rank(monkeypatch):
    plan, meshes = plan_for(monkeypatch, [], fsdp_on_one_rank=True)
    assert plan.fsdp and meshes == [("cpu", (1,), ("shard",))] and not plan.reshard_after_forward
    plan, _ = plan_for(monkeypatch, ["--sharding", "no-shard"], world=2, fsdp_on_one_rank=True)
    assert plan.fsdp and not plan.ddp
    plan, meshes = plan_for(monkeypatch, ["--cpu_offload"])
    assert plan.fsdp and plan.cpu_offload and meshes == [("cpu", (1,), ("shard",))]


def test_decentralized_has_no_fsdp_and_no_ddp(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--data_parallel", "decentralized"], world=4)
    assert plan.decentralized and not plan.fsdp and not plan.ddp and meshes == []
    assert (plan.mesh_shape, plan.shard_ranks) == ((4,), 1)
    assert plan.describe(1) == "no FSDP: a whole replica per rank, averaged with its neighbours' by gossip"


def test_loading_all_weights_builds_on_the_meta_device(monkeypatch):
    assert plan_for(monkeypatch, [], loads_weights=True)[0].meta_init
    assert plan_for(monkeypatch, ["--meta_init"])[0].meta_init
    assert not plan_for(monkeypatch, [])[0].meta_init


def test_fp8_recipe_is_checked_for_training_and_dropped_for_generation(monkeypatch):
    with pytest.raises(ConfigError):  # no CUDA here: the one-line error, before any model is built
        plan_for(monkeypatch, ["--precision", "fp8"])
    plan, _ = plan_for(monkeypatch, ["--precision", "fp8", "--max_epochs", -1])
    assert plan.fp8 is None and plan.bf16  # generation runs in bf16
    checked = []
    monkeypatch.setattr(parallelize.fp8, "check_device", checked.append)
    plan, _ = plan_for(monkeypatch, ["--precision", "fp8", "--fp8_recipe", "rowwise"])
    assert plan.fp8 == "rowwise" and checked == [torch.device("cpu")]


@pytest.mark.parametrize("flags,world,graphs", [
    (["--compile"], 1, None),  # unset: by the model's size
    (["--compile", "--sharding", "no-shard"], 2, None),  # DDP
    (["--compile", "--cuda_graphs"], 1, True), (["--compile", "--no-cuda_graphs"], 1, False),
    ([], 1, False),  # nothing compiled, nothing to replay
    # FSDP: by size or asked for; ParallelPlan.replays_graphs keeps them off where FSDP2's hooks surround the graph
    (["--compile"], 2, None), (["--compile", "--cuda_graphs"], 2, True),
    (["--compile", "--data_parallel", "decentralized"], 2, False),  # gossip: only when asked for
    (["--compile", "--data_parallel", "decentralized", "--cuda_graphs"], 2, True)])
def test_cuda_graphs_setting_of_each_launch(monkeypatch, flags, world, graphs):
    plan, _ = plan_for(monkeypatch, flags, world=world, device="cuda")
    assert plan.cuda_graphs is graphs
    assert plan_for(monkeypatch, flags, world=world)[0].cuda_graphs is False  # CPU: no CUDA graphs


def test_cuda_graphs_unset_replay_small_models_only(monkeypatch):
    monkeypatch.setattr(parallelize.fp8, "check_device", lambda device: None)
    plan, _ = plan_for(monkeypatch, ["--compile", "--precision", "fp8"], device="cuda")
    assert plan.cuda_graphs is False  # float8 layers: not measured under graphs, so only when asked for
    small = parallelize.GRAPHS_MODEL
    assert plain_plan(cuda_graphs=None).replays_graphs(small)
    assert not plain_plan(cuda_graphs=None).replays_graphs(small + 1)
    assert plain_plan(cuda_graphs=True).replays_graphs(small + 1)
    assert not plain_plan(cuda_graphs=False).replays_graphs(1)
    assert plain_plan(fsdp=False, cuda_graphs=None).describe(small) == \
        "no FSDP: one rank holds the whole model, replayed as CUDA graphs"
    assert plain_plan(fsdp=False, ddp=True, cuda_graphs=None, fsdp_unit="block").describe(small + 1) == \
        "no FSDP: the whole model on every rank, gradients all-reduced by DDP (no-shard)"


def plain_plan(**fields):
    base = dict(sharding="full-shard", decentralized=False, fsdp=True, mesh_shape=(2,), shard_ranks=2,
                reshard_after_forward=True, precision="bf16", cpu_offload=False, meta_init=False,
                activation_checkpoints=False, recompute="full", compile=False, cuda_graphs=False)
    base.update(fields)
    return parallelize.ParallelPlan(**base)


def test_what_the_plan_says_of_itself():
    assert plain_plan(precision="bf16").bf16 and plain_plan(precision="fp8").bf16
    assert not plain_plan(precision="float32").bf16
    assert plain_plan(fp8="tensorwise").fp8_all_gather
    assert not plain_plan(fp8="rowwise").fp8_all_gather and not plain_plan(fp8=None).fp8_all_gather
    for no in (dict(fsdp=False), dict(shard_ranks=1), dict(cpu_offload=True)):
        assert not plain_plan(fp8="tensorwise", **no).fp8_all_gather, no
    assert plain_plan(reshard_after_forward=False).stays_gathered
    assert not plain_plan(reshard_after_forward=True).stays_gathered
    assert not plain_plan(fsdp=False, reshard_after_forward=False).stays_gathered


@pytest.mark.parametrize("unit,params,whole", [("auto", SMALL_MODEL, True), ("auto", SMALL_MODEL + 1, False),
                                               ("block", 1, False), ("model", 10 * SMALL_MODEL, True)])
def test_the_fsdp_unit_rule(unit, params, whole):
    assert plain_plan(fsdp_unit=unit).whole_model_unit(params) == whole
    assert not plain_plan(fsdp=False, fsdp_unit=unit).whole_model_unit(params)  # no FSDP, no unit
    assert plain_plan(fsdp=False, ddp=True, fsdp_unit=unit).gathered_whole(params) == whole  # no-shard's replicas
    assert not plain_plan(fsdp=False, fsdp_unit=unit).gathered_whole(params)  # one rank: a plain module


@pytest.fixture
def group(one_rank_group):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))


@pytest.mark.parametrize("whole", [False, True])
def test_shard_makes_the_units_it_is_asked_for(group, whole):
    """Per block: every block its own FSDP unit, resharded after forward but the last; whole: the root alone,
    never resharded after forward. bf16 gathers in bf16 and reduces in fp32; offload keeps shards on the CPU."""
    plan = plain_plan(mesh=group, cpu_offload=True)
    model = shard(GPT(CONFIG), plan, whole)
    assert isinstance(model, FSDPModule)
    assert [isinstance(b, FSDPModule) for b in model.blocks] == [not whole] * 3
    root = model._get_fsdp_state()
    states = [root] + ([] if whole else [b._get_fsdp_state() for b in model.blocks])
    reshards = [s._fsdp_param_group.post_forward_mesh_info is not None for s in states]
    assert reshards == ([False] if whole else [True, True, True, False])
    for state in states:
        assert state._fsdp_param_group.mesh_info.mesh is group  # the plan's mesh, not a default one
        assert state._mp_policy.param_dtype == torch.bfloat16 and state._mp_policy.reduce_dtype == torch.float32
        offload = state._fsdp_param_group.offload_policy
        assert isinstance(offload, CPUOffloadPolicy) and offload.pin_memory is torch.cuda.is_available()
    fp32 = shard(GPT(CONFIG), plain_plan(mesh=group, precision="float32"), whole)._get_fsdp_state()
    assert fp32._mp_policy.param_dtype is None and fp32._mp_policy.reduce_dtype is None
    assert not isinstance(fp32._fsdp_param_group.offload_policy, CPUOffloadPolicy)


@pytest.mark.parametrize("unit", ["block", "model"])
def test_build_model_compiles_per_block_or_whole(group, unit):
    plan = plain_plan(mesh=group, compile=True, fsdp_unit=unit, reshard_after_forward=False)
    model = build_model(GPT, CONFIG, plan, SimpleNamespace(device=torch.device("cpu")), seed=0)
    compiled_blocks = [getattr(b.forward, "__wrapped__", None) == type(b).forward.__get__(b) for b in model.blocks]
    assert compiled_blocks == [unit == "block"] * 3
    assert hasattr(model.trunk, "__wrapped__") == (unit == "model")
    sync = gradient_sync(model, plan)
    if unit == "model":  # whole_unit.py's one unit, stepped by its own sync
        assert isinstance(sync, WholeUnitSync) and isinstance(model.whole_unit, WholeUnit)
    else:
        assert isinstance(sync, FSDPSync) and sync.stays_gathered
        resharding = dataclasses.replace(plan, reshard_after_forward=True)
        assert not gradient_sync(model, resharding).stays_gathered


def test_plain_and_ddp_models_get_their_syncs():
    assert type(gradient_sync(torch.nn.Linear(2, 2), plain_plan(fsdp=False))) is LocalSync
    assert type(gradient_sync(torch.nn.Linear(2, 2), plain_plan(fsdp=False, ddp=True))) is DDPSync


def test_local_clip_returns_the_norm_and_clips_only_when_asked():
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])
    assert LocalSync().clip_grad_norm([weight], 0).item() == pytest.approx(5.0)
    assert weight.grad.tolist() == [3.0, 4.0]
    assert LocalSync().clip_grad_norm([weight], 1.0).item() == pytest.approx(5.0)
    assert torch.linalg.vector_norm(weight.grad).item() == pytest.approx(1.0, rel=1e-5)


def record_calls(monkeypatch, owner, name, result=lambda *args, **kwargs: None):
    calls = []

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return result(*args, **kwargs)
    monkeypatch.setattr(owner, name, recorder)
    return calls


CPU = SimpleNamespace(device=torch.device("cpu"))


def test_a_plain_bf16_model_runs_under_bf16_autocast(monkeypatch):
    calls = record_calls(monkeypatch, parallelize.torch, "autocast", lambda *args, **kwargs: (lambda f: f))
    build_model(GPT, CONFIG, plain_plan(fsdp=False, precision="bf16"), CPU, seed=0)
    assert calls == [(("cpu",), {"dtype": torch.bfloat16})]
    calls.clear()
    build_model(GPT, CONFIG, plain_plan(fsdp=False, precision="float32"), CPU, seed=0)
    assert calls == []


def test_ddp_replicates_the_model_without_rebroadcasting_buffers(monkeypatch):
    calls = record_calls(monkeypatch, parallelize, "replicate")
    ddp = plain_plan(fsdp=False, ddp=True, precision="float32", fsdp_unit="block")  # CONFIG's would be one unit
    model = build_model(GPT, CONFIG, ddp, CPU, seed=0)
    assert calls == [((model,), {"device_id": torch.device("cpu"), "broadcast_buffers": False,
                                 "gradient_as_bucket_view": True})]
    assert type(gradient_sync(model, ddp)) is DDPSync
    assert gradient_sync(model, ddp).model is model


@pytest.mark.parametrize("graphs", [True, False])
def test_ddp_with_graphs_compiles_one_graph_not_one_per_bucket(monkeypatch, graphs):
    """Under DDP, Dynamo cuts a compiled model at DDP's buckets (recipe S: 3 graphs, each replayed and run through
    autograd on its own); a model replayed as CUDA graphs is host-bound, so it stays one graph."""
    record_calls(monkeypatch, parallelize, "replicate")
    record_calls(monkeypatch, parallelize, "compiled_unless_caching", lambda f, mode=None: f)
    with torch._dynamo.config.patch(optimize_ddp=True):  # restored afterwards
        build_model(GPT, CONFIG, plain_plan(fsdp=False, ddp=True, compile=True, cuda_graphs=graphs, fsdp_unit="block"),
                    CPU, seed=0)
        assert torch._dynamo.config.optimize_ddp is (not graphs)


@pytest.mark.parametrize("graphs,limit,replays", [(False, None, False), (True, None, True), (None, None, True),
                                                   (None, 1000, False)])
def test_the_whole_trunk_is_compiled_and_replayed_as_graphs_when_asked(monkeypatch, graphs, limit, replays):
    """Unset, --cuda_graphs replays a model of at most GRAPHS_MODEL parameters (CONFIG's is tiny; limit lowers it)."""
    calls = record_calls(monkeypatch, parallelize, "compiled_unless_caching", lambda f, mode=None: f)
    if limit:
        monkeypatch.setattr(parallelize, "GRAPHS_MODEL", limit)
    model = build_model(GPT, CONFIG, plain_plan(fsdp=False, compile=True, cuda_graphs=graphs), CPU, seed=0)
    (args, kwargs), = calls
    assert args == (model.trunk, "reduce-overhead" if replays else None) and kwargs == {}
    assert hasattr(model.loss, "_torchdynamo_orig_callable")  # the loss compiled too (CPU: no fused kernel)


def test_uncompiled_models_keep_their_eager_loss():
    from minimal_fsdp.layers import cross_entropy
    model = build_model(GPT, CONFIG, plain_plan(fsdp=False), CPU, seed=0)
    assert model.loss is cross_entropy and not hasattr(model.trunk, "__wrapped__")


def test_generation_runs_the_eager_function_and_training_the_compiled_one(monkeypatch):
    modes = record_calls(monkeypatch, parallelize.torch, "compile",
                         lambda f, mode=None: (lambda *a, **k: ("compiled", a)))
    run = parallelize.compiled_unless_caching(lambda *a, **k: ("eager", a), "reduce-overhead")
    assert modes == [((run.__wrapped__,), {"mode": "reduce-overhead"})]
    cache = parallelize.KVCache.__new__(parallelize.KVCache)
    assert run(1, 2)[0] == "compiled" and run(1, cache)[0] == "eager" and run(1, cache=cache)[0] == "eager"


def test_every_path_gives_the_same_initial_weights(group):
    """Plain or sharded, built on the meta device or not, offloaded or not: the weights of seed 3."""
    plain = build_model(GPT, CONFIG, plain_plan(fsdp=False), CPU, seed=3).state_dict()
    meta = build_model(GPT, CONFIG, plain_plan(fsdp=False, meta_init=True), CPU, seed=3).state_dict()
    sharded = [build_model(GPT, CONFIG, plain_plan(mesh=group, precision="float32", **options), CPU, seed=3)
               for options in (dict(), dict(meta_init=True), dict(meta_init=True, cpu_offload=True))]
    for name, value in plain.items():
        assert torch.equal(meta[name], value), name
        for model in sharded:
            assert torch.equal(model.state_dict()[name].full_tensor(), value), name


@pytest.mark.parametrize("meta_init", [False, True])
def test_meta_init_builds_the_model_on_the_meta_device(meta_init):
    seen = []

    class Recorded(GPT):
        def __init__(self, config):
            seen.append(torch.empty(0).device.type)
            super().__init__(config)
    build_model(Recorded, CONFIG, plain_plan(fsdp=False, meta_init=meta_init), CPU, seed=0)
    assert seen == ["meta" if meta_init else "cpu"]


@pytest.mark.parametrize("limit_below_total,whole", [(False, True), (True, False)])
def test_the_unit_rule_counts_every_parameter_embeddings_included(group, monkeypatch, limit_below_total, whole):
    total = GPT(CONFIG).num_params(non_embedding=False)
    monkeypatch.setattr(parallelize, "SMALL_MODEL", total - 1 if limit_below_total else total)
    plan = plain_plan(mesh=group)
    model = build_model(GPT, CONFIG, plan, CPU, seed=0)
    assert [isinstance(b, FSDPModule) for b in model.blocks] == [not whole] * 3
    assert hasattr(model, "whole_unit") == whole
    assert isinstance(gradient_sync(model, plan), WholeUnitSync if whole else FSDPSync)


def test_ddp_syncs_on_the_last_micro_step_only():
    asked = []
    sync = DDPSync(SimpleNamespace(set_requires_gradient_sync=asked.append))
    sync.micro_step(last=False)
    sync.micro_step(last=True)
    assert asked == [False, True]


def test_fsdp_sync_reduces_the_norm_over_the_shard_group_and_precomputes_float8_scales(group, monkeypatch):
    precomputed = []
    monkeypatch.setattr(parallelize.fp8, "scale_precompute", lambda plan: precomputed.append)
    plan = plain_plan(mesh=group, precision="float32", fsdp_unit="block")  # FSDP2 (a small model: whole_unit.py)
    model = build_model(GPT, CONFIG, plan, CPU, seed=0)
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length))
    model(x, x).backward()
    sync = FSDPSync(model, plan)
    groups = record_calls(monkeypatch, parallelize.dist, "all_reduce")
    sync.clip_grad_norm(model.parameters(), 1.0)
    assert [kwargs["group"] for _, kwargs in groups] == [group.get_group("shard")]
    sync.after_step()
    assert precomputed == [model]


@pytest.mark.parametrize("unit", ["block", "model"])
@pytest.mark.parametrize("max_norm", [0.0, 0.05, 100.0])
def test_fsdp_clip_matches_torch_on_the_local_shards(group, max_norm, unit, monkeypatch):
    """The global norm (here one rank's) and the clipped gradients match torch's clip_grad_norm_ on plain copies;
    0 does not clip; a norm under max_norm leaves the gradients as they are. FSDP2's sync (block units) and the
    one unit's (whole_unit.py: its shards' gradients are one tensor)."""
    plan = plain_plan(mesh=group, precision="float32", fsdp_unit=unit)
    model = build_model(GPT, CONFIG, plan, CPU, seed=0)
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length))
    sync = gradient_sync(model, plan)
    model(x, x).backward()
    sync.finish()
    plain = [p.grad.full_tensor().clone().requires_grad_(False) for p in model.parameters()]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in plain]
    for p, g in zip(params, plain):
        p.grad = g
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))
    groups = record_calls(monkeypatch, parallelize.dist, "all_reduce")
    norm = sync.clip_grad_norm(model.parameters(), max_norm)
    assert [kwargs["group"] for _, kwargs in groups] == [group.get_group("shard")]  # one all-reduce, of the norm
    # The sum of squares is taken in another order than torch's: equal to a few units in the last place, well
    # under the clip's own epsilon (1e-6 / norm) that a wrong formula would move it by.
    torch.testing.assert_close(norm, expected, rtol=3e-7, atol=0)
    for p, q in zip(model.parameters(), params):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=3e-7, atol=0)
    if max_norm == 100.0:
        assert all(torch.equal(p.grad, g) for p, g in zip(params, plain))  # not scaled up
