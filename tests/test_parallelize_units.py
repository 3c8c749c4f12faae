"""plan.py's decisions and parallelize.py's application of them, in this process (fast, and what mutation testing
can see): the layout of every sharding, the one strategy and the plan make_plan builds from the flags, the launch
and the model's size, what it refuses, what the plan says of itself, what shard() hands to FSDP2 (units,
resharding, mixed precision, offload), what build_model compiles, which gradient sync a plan gets, and the
process-wide settings it needs. The multi-rank behaviour they lead to is checked in test_parallelize.py."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from minimal_fsdp import parallelize
from minimal_fsdp import plan as plan_module
from minimal_fsdp.choices import SMALL_MODEL
from minimal_fsdp.gossip import Gossip
from minimal_fsdp.whole_unit import WholeUnit
from minimal_fsdp.config import ConfigError, parse_args
from minimal_fsdp.llama import LlamaConfig
from minimal_fsdp.model import GPT, GPTConfig
from minimal_fsdp.models import MODELS
from minimal_fsdp.parallelize import (SYNCS, DDPSync, FSDPSync, LocalSync, build_model, gradient_sync,
                                      WholeUnitSync, shard)
from minimal_fsdp.plan import (STRATEGIES, apply_process_settings, count_params, layout, make_plan,
                               process_settings, strategy)

CONFIG = GPTConfig(vocab_size=64, seq_length=16, num_layers=3, num_heads=2, embed_size=16)
NUM_PARAMS = GPT(CONFIG).num_params(non_embedding=False)


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


def plan_for(monkeypatch, flags, world=1, local=None, device="cpu", config=CONFIG, **options):
    """make_plan on a pretend launch; the mesh make_plan asks for is recorded, not built."""
    meshes = []
    monkeypatch.setattr(plan_module, "init_device_mesh",
                        lambda kind, shape, mesh_dim_names: meshes.append((kind, shape, mesh_dim_names)) or "mesh")
    env = SimpleNamespace(device=torch.device(device), world_size=world, local_world_size=local or world)
    plan = make_plan(parse_args([str(f) for f in flags]), env, config, **options)
    return plan, meshes


def large(monkeypatch):
    """CONFIG counts as a large model: over --fsdp_unit auto's and --cuda_graphs auto's bounds."""
    monkeypatch.setattr(plan_module, "SMALL_MODEL", NUM_PARAMS - 1)
    monkeypatch.setattr(plan_module, "GRAPHS_MODEL", NUM_PARAMS - 1)


def test_one_rank_is_a_plain_module(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--precision", "bf16", "--compile", "--activation_checkpoints",
                                          "--recompute", "selective", "--fsdp_unit", "block"])
    assert plan.strategy == "local" and not plan.fsdp and not plan.ddp and not plan.decentralized
    assert meshes == [] and plan.mesh is None and plan.num_params == NUM_PARAMS
    assert (plan.mesh_shape, plan.shard_ranks, plan.reshard_after_forward) == ((1,), 1, False)
    assert (plan.precision, plan.compile, plan.activation_checkpoints, plan.recompute) == \
        ("bf16", True, True, "selective")
    assert not plan.meta_init and not plan.cpu_offload and plan.fp8 is None and not plan.cuda_graphs
    assert plan.describe() == "no FSDP: one rank holds the whole model"


def test_fsdp_over_ranks_asks_for_the_strategys_mesh(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--sharding", "full-shard"], world=4)
    assert plan.strategy == "one-unit" and not plan.fsdp and plan.mesh == "mesh"  # a small model: whole_unit.py
    assert meshes == [("cpu", (4,), ("shard",))]
    assert (plan.mesh_shape, plan.shard_ranks, plan.reshard_after_forward) == ((4,), 4, True)
    assert plan.describe() == "mesh shard=4 (full-shard), the whole model as one unit, one all-gather a step"
    large(monkeypatch)
    plan, meshes = plan_for(monkeypatch, ["--sharding", "full-shard"], world=4)
    assert plan.strategy == "fsdp-block" and plan.fsdp and meshes == [("cpu", (4,), ("shard",))]
    assert plan.describe() == "mesh shard=4 (full-shard), an FSDP unit per block"


def test_hybrid_shards_over_the_ranks_of_a_node_unless_told(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--sharding", "hybrid-grad-shard"], world=8, local=4)
    assert meshes == [("cpu", (2, 4), ("replicate", "shard"))] and plan.shard_ranks == 4
    assert not plan.reshard_after_forward and not plan.stays_gathered  # the one unit is not FSDP2
    assert plan.describe() == \
        "mesh replicate=2 x shard=4 (hybrid-grad-shard), the whole model as one unit, one all-gather a step"
    _, meshes = plan_for(monkeypatch, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2], world=8, local=4)
    assert meshes == [("cpu", (4, 2), ("replicate", "shard"))]


def test_no_shard_is_the_one_unit_or_ddp_unless_offloaded(monkeypatch):
    """no-shard over several ranks: a small model is whole_unit.py's unit on a (ranks x 1) mesh (a large one, or
    --fsdp_unit block, or float8 layers, is DDP's: no mesh); offloaded, FSDP2 over that mesh."""
    plan, meshes = plan_for(monkeypatch, ["--sharding", "no-shard"], world=2)
    assert plan.strategy == "one-unit" and meshes == [("cpu", (2, 1), ("replicate", "shard"))]
    assert plan.shard_ranks == 1 and plan.mesh_shape == (2, 1)
    assert plan.describe() == "no sharding: the whole model on every rank as one unit, gradients averaged by one " \
        "all-reduce a step (no-shard)"
    plan, meshes = plan_for(monkeypatch, ["--sharding", "no-shard", "--fsdp_unit", "block"], world=2)
    assert plan.strategy == "ddp" and plan.ddp and meshes == [] and plan.mesh is None
    assert plan.describe() == "no FSDP: the whole model on every rank, gradients all-reduced by DDP (no-shard)"
    plan, meshes = plan_for(monkeypatch, ["--sharding", "no-shard", "--cpu_offload"], world=2)
    assert plan.strategy == "fsdp-whole" and plan.cpu_offload and meshes == [("cpu", (2, 1), ("replicate", "shard"))]
    plan, _ = plan_for(monkeypatch, ["--sharding", "no-shard"], world=1)
    assert plan.strategy == "local"  # one rank: nothing to average
    large(monkeypatch)
    assert plan_for(monkeypatch, ["--sharding", "no-shard"], world=2)[0].strategy == "ddp"


def test_fsdp_on_one_rank_and_offload_on_one_rank(monkeypatch):
    plan, meshes = plan_for(monkeypatch, [], fsdp_on_one_rank=True)
    assert plan.strategy == "one-unit" and meshes == [("cpu", (1,), ("shard",))] and not plan.reshard_after_forward
    plan, _ = plan_for(monkeypatch, ["--fsdp_unit", "block"], fsdp_on_one_rank=True)
    assert plan.strategy == "fsdp-block" and plan.stays_gathered  # one rank: nothing reshards after forward
    plan, _ = plan_for(monkeypatch, ["--sharding", "no-shard", "--fsdp_unit", "block"], world=2, fsdp_on_one_rank=True)
    assert plan.strategy == "fsdp-block"
    plan, meshes = plan_for(monkeypatch, ["--cpu_offload"])
    assert plan.strategy == "fsdp-whole" and plan.cpu_offload and meshes == [("cpu", (1,), ("shard",))]


def test_decentralized_has_no_fsdp_and_no_ddp(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--data_parallel", "decentralized", "--topology", "ring"], world=4)
    assert plan.strategy == "gossip" and plan.decentralized and plan.topology == "ring" and meshes == []
    assert (plan.mesh_shape, plan.shard_ranks) == ((4,), 1)
    assert plan.describe() == "no FSDP: a whole replica per rank, averaged with its neighbours' by gossip"
    assert plan_for(monkeypatch, [], world=1)[0].topology is None


def test_loading_all_weights_builds_on_the_meta_device(monkeypatch):
    assert plan_for(monkeypatch, [], loads_weights=True)[0].meta_init
    assert plan_for(monkeypatch, ["--meta_init"])[0].meta_init
    assert not plan_for(monkeypatch, [])[0].meta_init


def test_fp8_recipe_is_checked_for_training_and_dropped_for_generation(monkeypatch):
    with pytest.raises(ConfigError):  # no CUDA here: the one-line error, before any model is built
        plan_for(monkeypatch, ["--precision", "fp8"])
    plan, _ = plan_for(monkeypatch, ["--precision", "fp8", "--max_epochs", -1])
    assert plan.fp8 is None and plan.precision == "bf16" and plan.bf16  # generation runs in bf16
    checked = []
    monkeypatch.setattr(plan_module.fp8, "check_device", checked.append)
    plan, _ = plan_for(monkeypatch, ["--precision", "fp8", "--fp8_recipe", "rowwise"])
    assert plan.fp8 == "rowwise" and plan.precision == "fp8" and checked == [torch.device("cpu")]
    plan, _ = plan_for(monkeypatch, ["--precision", "fp8", "--sharding", "full-shard"], world=2)
    assert plan.strategy == "fsdp-whole"  # float8 all-gathers are FSDP2's (torchao): not the one unit


@pytest.mark.parametrize("flags,world,graphs", [
    (["--compile"], 1, True),  # unset: by the model's size (CONFIG's is tiny)
    (["--compile", "--sharding", "no-shard"], 2, True),  # the one unit over replicas
    (["--compile", "--sharding", "no-shard", "--fsdp_unit", "block"], 2, True),  # DDP
    (["--compile", "--cuda_graphs"], 1, True), (["--compile", "--no-cuda_graphs"], 1, False),
    ([], 1, False),  # nothing compiled, nothing to replay
    (["--compile"], 2, True),  # full-shard's one unit
    (["--compile", "--fsdp_unit", "block"], 2, False),  # FSDP2's hooks surround each block
    (["--compile", "--cpu_offload"], 2, False),  # FSDP2's whole unit
    (["--compile", "--data_parallel", "decentralized"], 2, False),  # gossip: only when asked for
    (["--compile", "--data_parallel", "decentralized", "--cuda_graphs"], 2, True)])
def test_cuda_graphs_decided_once_for_each_launch(monkeypatch, flags, world, graphs):
    plan, _ = plan_for(monkeypatch, flags, world=world, device="cuda")
    assert plan.cuda_graphs is graphs
    assert ("replayed as CUDA graphs" in plan.describe()) == graphs
    if "--cuda_graphs" not in flags:
        assert plan_for(monkeypatch, flags, world=world)[0].cuda_graphs is False  # CPU: no CUDA graphs


@pytest.mark.parametrize("flags,world,named", [
    (["--fsdp_unit", "block"], 2, "--fsdp_unit block"),
    (["--cpu_offload"], 2, "--cpu_offload"), (["--cpu_offload"], 1, "--cpu_offload"),
    (["--sharding", "hybrid-full-shard", "--shard_group_size", 1, "--fsdp_unit", "block"], 2, "--fsdp_unit block")])
def test_an_explicit_cuda_graphs_that_cannot_apply_is_refused(monkeypatch, flags, world, named):
    """FSDP2 gathers the parameters at new addresses every step, which replayed graphs would not see: --cuda_graphs
    there is refused in one line naming both flags, not dropped; on the CPU there are no CUDA graphs at all."""
    with pytest.raises(ConfigError, match="--cuda_graphs") as refused:
        plan_for(monkeypatch, [*flags, "--compile", "--cuda_graphs"], world=world, device="cuda")
    assert named in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="--cuda_graphs replays CUDA graphs; this run is on cpu"):
        plan_for(monkeypatch, ["--compile", "--cuda_graphs"])
    large(monkeypatch)
    with pytest.raises(ConfigError, match="a model of over"):  # FSDP2 per block by size
        plan_for(monkeypatch, ["--compile", "--cuda_graphs"], world=2, device="cuda")


def test_cuda_graphs_unset_replay_small_models_only(monkeypatch):
    monkeypatch.setattr(plan_module.fp8, "check_device", lambda device: None)
    plan, _ = plan_for(monkeypatch, ["--compile", "--precision", "fp8"], device="cuda")
    assert plan.cuda_graphs is False  # float8 layers: not measured under graphs, so only when asked for
    plan, _ = plan_for(monkeypatch, ["--compile", "--precision", "fp8", "--cuda_graphs"], device="cuda")
    assert plan.cuda_graphs is True  # asked for, on one rank: no FSDP2 hooks
    monkeypatch.setattr(plan_module, "GRAPHS_MODEL", NUM_PARAMS)
    assert plan_for(monkeypatch, ["--compile"], device="cuda")[0].cuda_graphs
    monkeypatch.setattr(plan_module, "GRAPHS_MODEL", NUM_PARAMS - 1)
    assert not plan_for(monkeypatch, ["--compile"], device="cuda")[0].cuda_graphs
    assert plan_for(monkeypatch, ["--compile", "--cuda_graphs"], device="cuda")[0].cuda_graphs  # any size


def plain_plan(**fields):
    base = dict(strategy="fsdp-block", sharding="full-shard", mesh_shape=(2,), shard_ranks=2,
                reshard_after_forward=True, precision="bf16", fp8=None, cpu_offload=False, meta_init=False,
                activation_checkpoints=False, recompute="full", compile=False, cuda_graphs=False,
                num_params=NUM_PARAMS)
    base.update(fields)
    return plan_module.ParallelPlan(**base)


def test_what_the_plan_says_of_itself():
    assert plain_plan(precision="bf16").bf16 and plain_plan(precision="fp8").bf16
    assert not plain_plan(precision="float32").bf16 and plain_plan(precision="float32").compute_dtype == torch.float32
    assert plain_plan(fp8="tensorwise").fp8_all_gather
    assert not plain_plan(fp8="rowwise").fp8_all_gather and not plain_plan(fp8=None).fp8_all_gather
    for no in (dict(strategy="local"), dict(strategy="ddp"), dict(shard_ranks=1), dict(cpu_offload=True)):
        assert not plain_plan(fp8="tensorwise", **no).fp8_all_gather, no
    assert plain_plan(reshard_after_forward=False).stays_gathered
    assert not plain_plan(reshard_after_forward=True).stays_gathered
    assert plain_plan(strategy="fsdp-whole", reshard_after_forward=True).stays_gathered  # FSDP2's one unit
    assert not plain_plan(strategy="one-unit", reshard_after_forward=False).stays_gathered  # not FSDP2
    assert [plain_plan(strategy=s, compile=True).compiles_whole for s in STRATEGIES] == \
        [s != "fsdp-block" for s in STRATEGIES]
    assert not plain_plan(strategy="local", compile=False).compiles_whole


@pytest.mark.parametrize("args,chosen", [
    (("full-shard", 1, 10), "local"), (("no-shard", 1, 10), "local"),
    (("full-shard", 2, SMALL_MODEL), "one-unit"), (("full-shard", 2, SMALL_MODEL + 1), "fsdp-block"),
    (("full-shard", 2, 10, "block"), "fsdp-block"), (("full-shard", 2, 10 * SMALL_MODEL, "model"), "one-unit"),
    (("no-shard", 2, SMALL_MODEL), "one-unit"), (("no-shard", 2, SMALL_MODEL + 1), "ddp"),
    (("no-shard", 2, 10, "block"), "ddp"), (("no-shard", 2, 10, "auto", False, True), "ddp"),
    (("no-shard", 2, 10, "auto", True), "fsdp-whole"), (("full-shard", 1, 10, "auto", True), "fsdp-whole"),
    (("full-shard", 1, SMALL_MODEL + 1, "auto", True), "fsdp-block"),
    (("full-shard", 2, 10, "auto", False, True), "fsdp-whole"),
    (("hybrid-grad-shard", 8, 10, "model", False, False, True), "gossip"),
    (("full-shard", 1, 10, "auto", False, False, False, True), "one-unit"),
    (("full-shard", 1, 10, "block", False, False, False, True), "fsdp-block")])
def test_one_strategy_per_launch_and_model(args, chosen):
    """plan.strategy: (sharding, world, parameters, fsdp_unit, cpu_offload, float8, decentralized, fsdp_on_one_rank)
    -> the one strategy; the memory planner asks the same function."""
    assert strategy(*args) == chosen


@pytest.mark.parametrize("make", [lambda: CONFIG, lambda: LlamaConfig(vocab_size=64, seq_length=16, num_layers=3,
                                                                        num_heads=2, num_kv_heads=1, embed_size=16,
                                                                        intermediate_size=32)])
def test_the_plan_counts_every_parameter_from_the_config(make):
    """From the config alone (one block on the meta device), exactly what the built model counts: embeddings and
    tied weights included, once."""
    config = make()
    with torch.device("meta"):
        model = MODELS[config.model_type](config)
    assert count_params(config) == model.num_params(non_embedding=False) == \
        sum(p.numel() for p in model.parameters())


def test_build_model_refuses_a_plan_made_for_another_model():
    with pytest.raises(ValueError, match="make_plan with this model's config"):
        build_model(GPT, CONFIG, plain_plan(strategy="local", num_params=NUM_PARAMS + 1), CPU, seed=0)


@pytest.fixture
def group(one_rank_group):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))


@pytest.mark.parametrize("whole", [False, True])
def test_shard_makes_the_units_it_is_asked_for(group, whole):
    """Per block: every block its own FSDP unit, resharded after forward but the last; whole: the root alone,
    never resharded after forward. bf16 gathers in bf16 and reduces in fp32; offload keeps shards on the CPU."""
    strategy = "fsdp-whole" if whole else "fsdp-block"
    plan = plain_plan(strategy=strategy, mesh=group, cpu_offload=True)
    model = shard(GPT(CONFIG), plan)
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
    fp32 = shard(GPT(CONFIG), plain_plan(strategy=strategy, mesh=group, precision="float32"))._get_fsdp_state()
    assert fp32._mp_policy.param_dtype is None and fp32._mp_policy.reduce_dtype is None
    assert not isinstance(fp32._fsdp_param_group.offload_policy, CPUOffloadPolicy)


@pytest.mark.parametrize("strategy", ["fsdp-block", "fsdp-whole", "one-unit"])
def test_build_model_compiles_per_block_or_whole(group, strategy):
    plan = plain_plan(strategy=strategy, mesh=group, compile=True, reshard_after_forward=False)
    model = build_model(GPT, CONFIG, plan, SimpleNamespace(device=torch.device("cpu")), seed=0)
    compiled_blocks = [getattr(b.forward, "__wrapped__", None) == type(b).forward.__get__(b) for b in model.blocks]
    assert compiled_blocks == [strategy == "fsdp-block"] * 3
    assert hasattr(model.trunk, "__wrapped__") == (strategy != "fsdp-block")
    assert isinstance(model, FSDPModule) == (strategy != "one-unit")
    sync = gradient_sync(model, plan)
    if strategy == "one-unit":  # whole_unit.py's one unit, stepped by its own sync
        assert isinstance(sync, WholeUnitSync) and isinstance(model.whole_unit, WholeUnit)
    else:
        assert isinstance(sync, FSDPSync) and sync.stays_gathered
        resharding = dataclasses.replace(plan, reshard_after_forward=True)
        assert gradient_sync(model, resharding).stays_gathered == (strategy == "fsdp-whole")


def test_every_strategy_has_its_gradient_sync(one_rank_group):
    """One table, by strategy: nothing looks at the model to choose."""
    assert set(SYNCS) == set(STRATEGIES)
    assert type(gradient_sync(torch.nn.Linear(2, 2), plain_plan(strategy="local"))) is LocalSync
    assert type(gradient_sync(torch.nn.Linear(2, 2), plain_plan(strategy="ddp"))) is DDPSync
    gossip = gradient_sync(torch.nn.Linear(2, 2), plain_plan(strategy="gossip", topology="exp"))
    assert type(gossip) is Gossip and gossip.topology == "exp"


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
    build_model(GPT, CONFIG, plain_plan(strategy="local", precision="bf16"), CPU, seed=0)
    assert calls == [(("cpu",), {"dtype": torch.bfloat16})]
    calls.clear()
    build_model(GPT, CONFIG, plain_plan(strategy="local", precision="float32"), CPU, seed=0)
    assert calls == []


def test_ddp_replicates_the_model_without_rebroadcasting_buffers(monkeypatch):
    calls = record_calls(monkeypatch, parallelize, "replicate")
    ddp = plain_plan(strategy="ddp", precision="float32")
    model = build_model(GPT, CONFIG, ddp, CPU, seed=0)
    assert calls == [((model,), {"device_id": torch.device("cpu"), "broadcast_buffers": False,
                                 "gradient_as_bucket_view": True})]
    assert type(gradient_sync(model, ddp)) is DDPSync
    assert gradient_sync(model, ddp).model is model


@pytest.mark.parametrize("graphs", [True, False])
def test_ddp_with_graphs_compiles_one_graph_not_one_per_bucket(monkeypatch, graphs):
    """Under DDP, Dynamo cuts a compiled model at DDP's buckets (recipe S: 3 graphs, each replayed and run through
    autograd on its own); a model replayed as CUDA graphs is host-bound, so it stays one graph. The setting is
    process-wide: the plan names it, run.plan_run applies it at the start of the run, build_model leaves it alone."""
    ddp = plain_plan(strategy="ddp", compile=True, cuda_graphs=graphs)
    assert process_settings(ddp) == ({"torch._dynamo.config.optimize_ddp": False} if graphs else {})
    for other in ("local", "one-unit", "gossip"):
        assert process_settings(dataclasses.replace(ddp, strategy=other)) == {}
    record_calls(monkeypatch, parallelize, "replicate")
    record_calls(monkeypatch, parallelize, "compiled_unless_caching", lambda f, mode=None: f)
    with torch._dynamo.config.patch(optimize_ddp=True):  # restored afterwards
        build_model(GPT, CONFIG, ddp, CPU, seed=0)
        assert torch._dynamo.config.optimize_ddp is True
        apply_process_settings(ddp)
        assert torch._dynamo.config.optimize_ddp is (not graphs)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_whole_trunk_is_compiled_and_replayed_as_graphs_as_planned(monkeypatch, graphs):
    calls = record_calls(monkeypatch, parallelize, "compiled_unless_caching", lambda f, mode=None: f)
    model = build_model(GPT, CONFIG, plain_plan(strategy="local", compile=True, cuda_graphs=graphs), CPU, seed=0)
    (args, kwargs), = calls
    assert args == (model.trunk, "reduce-overhead" if graphs else None) and kwargs == {}
    assert hasattr(model.loss, "_torchdynamo_orig_callable")  # the loss compiled too (CPU: no fused kernel)


def test_uncompiled_models_keep_their_eager_loss():
    from minimal_fsdp.layers import cross_entropy
    model = build_model(GPT, CONFIG, plain_plan(strategy="local"), CPU, seed=0)
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
    plain = build_model(GPT, CONFIG, plain_plan(strategy="local"), CPU, seed=3).state_dict()
    meta = build_model(GPT, CONFIG, plain_plan(strategy="local", meta_init=True), CPU, seed=3).state_dict()
    sharded = [build_model(GPT, CONFIG, plain_plan(mesh=group, precision="float32", **options), CPU, seed=3)
               for options in (dict(), dict(meta_init=True), dict(meta_init=True, cpu_offload=True),
                               dict(strategy="one-unit"), dict(strategy="one-unit", meta_init=True))]
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
    build_model(Recorded, CONFIG, plain_plan(strategy="local", meta_init=meta_init), CPU, seed=0)
    assert seen == ["meta" if meta_init else "cpu"]


@pytest.mark.parametrize("limit_below_total,whole", [(False, True), (True, False)])
def test_the_unit_rule_counts_every_parameter_embeddings_included(group, monkeypatch, limit_below_total, whole):
    monkeypatch.setattr(plan_module, "SMALL_MODEL", NUM_PARAMS - 1 if limit_below_total else NUM_PARAMS)
    monkeypatch.setattr(plan_module, "init_device_mesh", lambda *args, **kwargs: group)
    env = SimpleNamespace(device=torch.device("cpu"), world_size=1, local_world_size=1)
    plan = make_plan(parse_args([]), env, CONFIG, fsdp_on_one_rank=True)
    assert plan.strategy == ("one-unit" if whole else "fsdp-block")
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
    plan = plain_plan(mesh=group, precision="float32")  # FSDP2 per block
    model = build_model(GPT, CONFIG, plan, CPU, seed=0)
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length))
    model(x, x).backward()
    sync = FSDPSync(model, plan)
    groups = record_calls(monkeypatch, parallelize.dist, "all_reduce")
    sync.clip_grad_norm(model.parameters(), 1.0)
    assert [kwargs["group"] for _, kwargs in groups] == [group.get_group("shard")]
    sync.after_step()
    assert precomputed == [model]


@pytest.mark.parametrize("strategy", ["fsdp-block", "one-unit"])
@pytest.mark.parametrize("max_norm", [0.0, 0.05, 100.0])
def test_fsdp_clip_matches_torch_on_the_local_shards(group, max_norm, strategy, monkeypatch):
    """The global norm (here one rank's) and the clipped gradients match torch's clip_grad_norm_ on plain copies;
    0 does not clip; a norm under max_norm leaves the gradients as they are. FSDP2's sync (block units) and the
    one unit's (whole_unit.py: its shards' gradients are one tensor)."""
    plan = plain_plan(strategy=strategy, mesh=group, precision="float32")
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
