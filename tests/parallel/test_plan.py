"""plan.py's decisions, in this process (fast, and what mutation testing can see): the layout of
every sharding, the one strategy and the plan make_plan builds from the flags, the launch and the
model's size (its parameters counted from the config alone), what it refuses (an explicit
--cuda_graphs where FSDP2's hooks surround the graph, an fp8 recipe it cannot train), and what the
plan says of itself. What parallelize.py builds from a plan is test_parallelize.py's."""

from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.config.choices import SMALL_MODEL
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.families import make_config
from minimal_fsdp.models.llama import LlamaConfig
from minimal_fsdp.models.size import count_parameters
from minimal_fsdp.parallel import choose
from minimal_fsdp.parallel import plan as plan_module
from minimal_fsdp.parallel.choose import layout, reduce_precision, strategy
from minimal_fsdp.parallel.plan import STRATEGIES, make_plan

from support import CONFIG, NUM_PARAMS, plain_plan


@pytest.mark.parametrize(
    "sharding,world,group,expected",
    [
        ("full-shard", 4, 2, ((4,), 4, True)),
        ("full-shard", 2, 2, ((2,), 2, True)),
        ("grad-shard", 4, 2, ((4,), 4, False)),
        ("no-shard", 4, 2, ((4, 1), 1, False)),
        ("hybrid-full-shard", 8, 4, ((2, 4), 4, True)),
        ("hybrid-grad-shard", 8, 4, ((2, 4), 4, False)),
        ("hybrid-full-shard", 4, 1, ((4, 1), 1, False)),  # a shard group of one: nothing to reshard
        ("full-shard", 1, 1, ((1,), 1, False)),
    ],
)
def test_layout_of_every_strategy(sharding, world, group, expected):
    assert layout(sharding, world, group) == expected


def plan_for(monkeypatch, flags, world=1, local=None, device="cpu", config=CONFIG, **options):
    """make_plan on a pretend launch; the mesh make_plan asks for is recorded, not built."""
    meshes = []
    monkeypatch.setattr(
        plan_module,
        "init_device_mesh",
        lambda kind, shape, mesh_dim_names: meshes.append((kind, shape, mesh_dim_names)) or "mesh",
    )
    env = SimpleNamespace(
        device=torch.device(device),
        world_size=world,
        local_world_size=local or world,
        num_nodes=world // (local or world),
    )
    plan = make_plan(parse_args([str(f) for f in flags]), env, config, **options)
    return plan, meshes


def large(monkeypatch):
    """CONFIG counts as a large model: over --fsdp_unit auto's and --cuda_graphs auto's bounds."""
    monkeypatch.setattr(choose, "SMALL_MODEL", NUM_PARAMS - 1)
    monkeypatch.setattr(plan_module, "GRAPHS_MODEL", NUM_PARAMS - 1)


def test_one_rank_is_a_plain_module(monkeypatch):
    plan, meshes = plan_for(
        monkeypatch,
        [
            "--precision",
            "bf16",
            "--compile",
            "--activation_checkpoints",
            "--recompute",
            "selective",
            "--fsdp_unit",
            "block",
        ],
    )
    assert plan.strategy == "local" and not plan.fsdp and not plan.ddp and not plan.decentralized
    assert meshes == [] and plan.mesh is None and plan.num_params == NUM_PARAMS
    assert (plan.mesh_shape, plan.shard_ranks, plan.reshard_after_forward) == ((1,), 1, False)
    assert (plan.precision, plan.compile, plan.activation_checkpoints, plan.recompute) == (
        "bf16",
        True,
        True,
        "selective",
    )
    assert not plan.meta_init and not plan.cpu_offload and plan.fp8 is None and not plan.cuda_graphs
    assert plan.describe() == "no FSDP: one rank holds the whole model"


def test_fsdp_over_ranks_asks_for_the_strategys_mesh(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--sharding", "full-shard"], world=4)
    # a small model: whole_unit.py
    assert plan.strategy == "one-unit" and not plan.fsdp and plan.mesh == "mesh"
    assert meshes == [("cpu", (4,), ("shard",))]
    assert (plan.mesh_shape, plan.shard_ranks, plan.reshard_after_forward) == ((4,), 4, True)
    assert (
        plan.describe()
        == "mesh shard=4 (full-shard), the whole model as one unit, one all-gather a step"
    )
    large(monkeypatch)
    plan, meshes = plan_for(monkeypatch, ["--sharding", "full-shard"], world=4)
    assert plan.strategy == "fsdp-block" and plan.fsdp and meshes == [("cpu", (4,), ("shard",))]
    assert plan.describe() == "mesh shard=4 (full-shard), an FSDP unit per block"


def test_hybrid_shards_over_the_ranks_of_a_node_unless_told(monkeypatch):
    plan, meshes = plan_for(monkeypatch, ["--sharding", "hybrid-grad-shard"], world=8, local=4)
    assert meshes == [("cpu", (2, 4), ("replicate", "shard"))] and plan.shard_ranks == 4
    assert not plan.reshard_after_forward and not plan.stays_gathered  # the one unit is not FSDP2
    assert (
        plan.describe()
        == "mesh replicate=2 x shard=4 (hybrid-grad-shard), the whole model as one unit, one "
        "all-gather a step"
    )
    _, meshes = plan_for(
        monkeypatch, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2], world=8, local=4
    )
    assert meshes == [("cpu", (4, 2), ("replicate", "shard"))]


def test_no_shard_is_the_one_unit_or_ddp_unless_offloaded(monkeypatch):
    """no-shard over several ranks: a small model is whole_unit.py's unit on a (ranks x 1) mesh (a
    large one, or --fsdp_unit block, or float8 layers, is DDP's: no mesh); offloaded, FSDP2 over
    that mesh."""
    plan, meshes = plan_for(monkeypatch, ["--sharding", "no-shard"], world=2)
    assert plan.strategy == "one-unit" and meshes == [("cpu", (2, 1), ("replicate", "shard"))]
    assert plan.shard_ranks == 1 and plan.mesh_shape == (2, 1)
    assert (
        plan.describe()
        == "no sharding: the whole model on every rank as one unit, gradients averaged by one "
        "all-reduce a step (no-shard)"
    )
    plan, meshes = plan_for(
        monkeypatch, ["--sharding", "no-shard", "--fsdp_unit", "block"], world=2
    )
    assert plan.strategy == "ddp" and plan.ddp and meshes == [] and plan.mesh is None
    assert (
        plan.describe()
        == "no FSDP: the whole model on every rank, gradients all-reduced by DDP (no-shard)"
    )
    plan, meshes = plan_for(monkeypatch, ["--sharding", "no-shard", "--cpu_offload"], world=2)
    assert (
        plan.strategy == "fsdp-whole"
        and plan.cpu_offload
        and meshes == [("cpu", (2, 1), ("replicate", "shard"))]
    )
    plan, _ = plan_for(monkeypatch, ["--sharding", "no-shard"], world=1)
    assert plan.strategy == "local"  # one rank: nothing to average
    large(monkeypatch)
    assert plan_for(monkeypatch, ["--sharding", "no-shard"], world=2)[0].strategy == "ddp"


def test_fsdp_on_one_rank_and_offload_on_one_rank(monkeypatch):
    plan, meshes = plan_for(monkeypatch, [], fsdp_on_one_rank=True)
    assert (
        plan.strategy == "one-unit"
        and meshes == [("cpu", (1,), ("shard",))]
        and not plan.reshard_after_forward
    )
    plan, _ = plan_for(monkeypatch, ["--fsdp_unit", "block"], fsdp_on_one_rank=True)
    # one rank: nothing reshards after forward
    assert plan.strategy == "fsdp-block" and plan.stays_gathered
    plan, _ = plan_for(
        monkeypatch,
        ["--sharding", "no-shard", "--fsdp_unit", "block"],
        world=2,
        fsdp_on_one_rank=True,
    )
    assert plan.strategy == "fsdp-block"
    plan, meshes = plan_for(monkeypatch, ["--cpu_offload"])
    assert (
        plan.strategy == "fsdp-whole" and plan.cpu_offload and meshes == [("cpu", (1,), ("shard",))]
    )


def test_decentralized_has_no_fsdp_and_no_ddp(monkeypatch):
    plan, meshes = plan_for(
        monkeypatch, ["--data_parallel", "decentralized", "--topology", "ring"], world=4
    )
    assert (
        plan.strategy == "gossip"
        and plan.decentralized
        and plan.topology == "ring"
        and meshes == []
    )
    assert (plan.mesh_shape, plan.shard_ranks) == ((4,), 1)
    assert (
        plan.describe()
        == "no FSDP: a whole replica per rank, averaged with its neighbours' by gossip"
    )
    assert plan_for(monkeypatch, [], world=1)[0].topology is None


def test_global_average_every_reaches_the_gossip(monkeypatch):
    """--global_average_every: the plan carries it, and the gradient sync built from the plan hands
    it to Gossip (test_gossip.py: what Gossip does with it)."""
    from minimal_fsdp.parallel import parallelize

    flags = ["--data_parallel", "decentralized", "--global_average_every", "5"]
    plan, _ = plan_for(monkeypatch, flags, world=4)
    assert plan.global_average_every == 5
    monkeypatch.setattr(parallelize, "Gossip", lambda *args, **kwargs: kwargs)
    assert parallelize.gradient_sync(object(), plan)["global_average_every"] == 5


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
    rowwise = ["--precision", "fp8", "--fp8_recipe", "rowwise", "--fp8_layers", "all"]
    plan, _ = plan_for(monkeypatch, rowwise)
    assert plan.fp8 == "rowwise" and plan.precision == "fp8" and checked == [torch.device("cpu")]
    plan, _ = plan_for(
        monkeypatch,
        ["--precision", "fp8", "--fp8_layers", "all", "--sharding", "full-shard"],
        world=2,
    )
    # float8 all-gathers are FSDP2's (torchao): not the one unit
    assert plan.strategy == "fsdp-whole" and plan.fp8_blocks and plan.fp8_all_gather


WIDE = LlamaConfig(vocab_size=64, num_layers=1, num_heads=32, embed_size=4096)


@pytest.mark.parametrize(
    "layers,config,blocks",
    [
        ("auto", CONFIG, False),  # narrow: the head alone
        ("auto", WIDE, True),  # choose.BLOCKS_MIN_WIDTH
        ("all", CONFIG, True),
        ("head", WIDE, False),
    ],
)
def test_fp8_layers_puts_the_blocks_in_float8_where_asked_and_the_head_always(
    monkeypatch, layers, config, blocks
):
    monkeypatch.setattr(plan_module.fp8, "check_device", lambda device: None)
    argv = ["--precision", "fp8", "--fp8_layers", layers, "--sharding", "full-shard"]
    plan, _ = plan_for(monkeypatch, argv, world=2, config=config)
    assert plan.fp8_blocks == blocks and plan.fp8_head
    # nothing to all-gather in float8 where the blocks stay bf16; the strategy is fp8's either way
    assert plan.fp8_all_gather == blocks and plan.strategy in ("fsdp-whole", "fsdp-block")
    assert choose.float8_blocks(layers, config.embed_size) == blocks


def test_fp8_rowwise_with_no_float8_layer_is_one_line(monkeypatch):
    """rowwise keeps the head bf16, so with the blocks bf16 too nothing would be float8."""
    monkeypatch.setattr(plan_module.fp8, "check_device", lambda device: None)
    for argv in (["--fp8_recipe", "rowwise"], ["--fp8_recipe", "rowwise", "--fp8_layers", "head"]):
        with pytest.raises(ConfigError, match="makes no layer of this model float8: --fp8_layers"):
            plan_for(monkeypatch, ["--precision", "fp8", *argv])
    plan, _ = plan_for(monkeypatch, ["--precision", "fp8", "--fp8_recipe", "rowwise"], config=WIDE)
    assert plan.fp8_blocks and not plan.fp8_head


@pytest.mark.parametrize(
    "flags,world,graphs",
    [
        (["--compile"], 1, True),  # unset: by the model's size (CONFIG's is tiny)
        (["--compile", "--sharding", "no-shard"], 2, True),  # the one unit over replicas
        (["--compile", "--sharding", "no-shard", "--fsdp_unit", "block"], 2, True),  # DDP
        (["--compile", "--cuda_graphs"], 1, True),
        (["--compile", "--no-cuda_graphs"], 1, False),
        ([], 1, False),  # nothing compiled, nothing to replay
        (["--compile"], 2, True),  # full-shard's one unit
        (["--compile", "--fsdp_unit", "block"], 2, False),  # FSDP2's hooks surround each block
        (["--compile", "--cpu_offload"], 2, False),  # FSDP2's whole unit
        (
            ["--compile", "--data_parallel", "decentralized"],
            2,
            False,
        ),  # gossip: only when asked for
        (["--compile", "--data_parallel", "decentralized", "--cuda_graphs"], 2, True),
    ],
)
def test_cuda_graphs_decided_once_for_each_launch(monkeypatch, flags, world, graphs):
    plan, _ = plan_for(monkeypatch, flags, world=world, device="cuda")
    assert plan.cuda_graphs is graphs
    assert ("replayed as CUDA graphs" in plan.describe()) == graphs
    if "--cuda_graphs" not in flags:
        # CPU: no CUDA graphs
        assert plan_for(monkeypatch, flags, world=world)[0].cuda_graphs is False


@pytest.mark.parametrize(
    "flags,world,compiled",
    [
        (["--compile"], 1, True),  # local
        (["--compile", "--sharding", "no-shard", "--fsdp_unit", "block"], 2, True),  # DDP
        (["--compile", "--fsdp_unit", "block"], 2, True),  # FSDP2: its local shards
        ([], 1, False),  # nothing compiled
        (["--compile"], 2, False),  # the one unit: LocalAdamW
        (["--compile", "--cpu_offload"], 2, False),  # fused AdamW on the CPU
        (["--compile", "--data_parallel", "decentralized"], 2, False),  # AccumAdamW
    ],
)
def test_the_compiled_optimizer_only_where_adamw_steps_gpu_tensors(
    monkeypatch, flags, world, compiled
):
    plan, _ = plan_for(monkeypatch, flags, world=world, device="cuda")
    assert plan.compiled_optimizer is compiled
    assert plan_for(monkeypatch, flags, world=world)[0].compiled_optimizer is False  # CPU


@pytest.mark.parametrize(
    "flags,world,copies",
    [
        (["--compile", "--precision", "bf16"], 1, True),
        (["--compile", "--precision", "fp8"], 1, True),
        (["--compile"], 1, False),  # float32: nothing to copy
        (["--precision", "bf16"], 1, False),  # uncompiled: autocast
        (
            ["--compile", "--precision", "bf16", "--sharding", "no-shard", "--fsdp_unit", "block"],
            2,
            False,
        ),  # DDP
        (["--compile", "--precision", "bf16", "--fsdp_unit", "block"], 2, False),  # FSDP2 casts
    ],
)
def test_one_gpu_computes_with_bf16_copies_where_the_compiled_optimizer_steps(
    monkeypatch, flags, world, copies
):
    monkeypatch.setattr(plan_module.fp8, "check_device", lambda device: None)
    plan, _ = plan_for(monkeypatch, flags, world=world, device="cuda")
    assert plan.bf16_weights is copies
    assert ("bf16 copies" in plan.describe()) is copies
    assert plan_for(monkeypatch, flags, world=world)[0].bf16_weights is False  # CPU: autocast


@pytest.mark.parametrize(
    "flags,world,named",
    [
        (["--fsdp_unit", "block"], 2, "--fsdp_unit block"),
        (["--cpu_offload"], 2, "--cpu_offload"),
        (["--cpu_offload"], 1, "--cpu_offload"),
        (
            ["--sharding", "hybrid-full-shard", "--shard_group_size", 1, "--fsdp_unit", "block"],
            2,
            "--fsdp_unit block",
        ),
    ],
)
def test_an_explicit_cuda_graphs_that_cannot_apply_is_refused(monkeypatch, flags, world, named):
    """FSDP2 gathers the parameters at new addresses every step, which replayed graphs would not
    see: --cuda_graphs there is refused in one line naming both flags, not dropped; on the CPU there
    are no CUDA graphs at all."""
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
    # float8 layers: not measured under graphs, so only when asked for
    assert plan.cuda_graphs is False
    plan, _ = plan_for(
        monkeypatch, ["--compile", "--precision", "fp8", "--cuda_graphs"], device="cuda"
    )
    assert plan.cuda_graphs is True  # asked for, on one rank: no FSDP2 hooks
    monkeypatch.setattr(plan_module, "GRAPHS_MODEL", NUM_PARAMS)
    assert plan_for(monkeypatch, ["--compile"], device="cuda")[0].cuda_graphs
    monkeypatch.setattr(plan_module, "GRAPHS_MODEL", NUM_PARAMS - 1)
    assert not plan_for(monkeypatch, ["--compile"], device="cuda")[0].cuda_graphs
    # any size
    assert plan_for(monkeypatch, ["--compile", "--cuda_graphs"], device="cuda")[0].cuda_graphs


def test_what_the_plan_says_of_itself():
    assert plain_plan(precision="bf16").bf16 and plain_plan(precision="fp8").bf16
    assert (
        not plain_plan(precision="float32").bf16
        and plain_plan(precision="float32").compute_dtype == torch.float32
    )
    assert plain_plan(fp8="tensorwise").fp8_all_gather
    assert not plain_plan(fp8="tensorwise", fp8_blocks=False).fp8_all_gather  # the head alone
    assert not plain_plan(fp8="rowwise").fp8_all_gather and not plain_plan(fp8=None).fp8_all_gather
    for no in (
        dict(strategy="local"),
        dict(strategy="ddp"),
        dict(shard_ranks=1),
        dict(cpu_offload=True),
    ):
        assert not plain_plan(fp8="tensorwise", **no).fp8_all_gather, no
    assert plain_plan(reshard_after_forward=False).stays_gathered
    assert not plain_plan(reshard_after_forward=True).stays_gathered
    # FSDP2's one unit
    assert plain_plan(strategy="fsdp-whole", reshard_after_forward=True).stays_gathered
    # not FSDP2
    assert not plain_plan(strategy="one-unit", reshard_after_forward=False).stays_gathered
    assert [plain_plan(strategy=s, compile=True).compiles_whole for s in STRATEGIES] == [
        s != "fsdp-block" for s in STRATEGIES
    ]
    assert not plain_plan(strategy="local", compile=False).compiles_whole


@pytest.mark.parametrize(
    "args,chosen",
    [
        (("full-shard", 1, 10), "local"),
        (("no-shard", 1, 10), "local"),
        (("full-shard", 2, SMALL_MODEL), "one-unit"),
        (("full-shard", 2, SMALL_MODEL + 1), "fsdp-block"),
        (("full-shard", 2, 10, "block"), "fsdp-block"),
        (("full-shard", 2, 10 * SMALL_MODEL, "model"), "one-unit"),
        (("no-shard", 2, SMALL_MODEL), "one-unit"),
        (("no-shard", 2, SMALL_MODEL + 1), "ddp"),
        (("no-shard", 2, 10, "block"), "ddp"),
        (("no-shard", 2, 10, "auto", False, True), "ddp"),
        (("no-shard", 2, 10, "auto", True), "fsdp-whole"),
        (("full-shard", 1, 10, "auto", True), "fsdp-whole"),
        (("full-shard", 1, SMALL_MODEL + 1, "auto", True), "fsdp-block"),
        (("full-shard", 2, 10, "auto", False, True), "fsdp-whole"),
        (("hybrid-grad-shard", 8, 10, "model", False, False, True), "gossip"),
        (("full-shard", 1, 10, "auto", False, False, False, True), "one-unit"),
        (("full-shard", 1, 10, "block", False, False, False, True), "fsdp-block"),
    ],
)
def test_one_strategy_per_launch_and_model(args, chosen):
    """plan.strategy: (sharding, world, parameters, fsdp_unit, cpu_offload, float8, decentralized,
    fsdp_on_one_rank) -> the one strategy; the memory planner asks the same function."""
    assert strategy(*args) == chosen


@pytest.mark.parametrize(
    "make",
    [
        lambda: CONFIG,
        lambda: LlamaConfig(
            vocab_size=64,
            seq_length=16,
            num_layers=3,
            num_heads=2,
            num_kv_heads=1,
            embed_size=16,
            intermediate_size=32,
        ),
    ],
)
def test_the_plan_counts_every_parameter_from_the_config(make):
    """From the config alone (one block on the meta device), exactly what the built model counts:
    embeddings and tied weights included, once."""
    config = make()
    with torch.device("meta"):
        model = MODELS[config.model_type](config)
    assert (
        count_parameters(config).total
        == model.num_params(non_embedding=False)
        == sum(p.numel() for p in model.parameters())
    )


@pytest.mark.parametrize(
    "flags,ranks,graphs",
    [
        (["--sharding", "full-shard"], 1, True),
        (["--sharding", "no-shard"], 2, True),
        # DDP
        (["--sharding", "no-shard", "--fsdp_unit", "block"], 2, True),
        # one unit: whole_unit.py
        (["--sharding", "full-shard"], 2, True),
        (["--sharding", "grad-shard"], 2, True),
        (["--sharding", "full-shard", "--fsdp_unit", "block"], 2, False),
        (["--sharding", "full-shard", "--cpu_offload"], 2, False),
    ],
)
def test_cuda_graphs_only_where_no_fsdp_hooks_surround_the_graph(monkeypatch, flags, ranks, graphs):
    """--cuda_graphs replays the compiled model: on one rank, under DDP (its all-reduce runs outside
    the graphs, on the gradients backward leaves) and as whole_unit.py's one unit (its parameters
    keep their addresses). FSDP2 frees and re-gathers the parameters each step at new addresses,
    which a replayed graph would not see: asked for there, it is refused in one line, not dropped.
    (Plans only: no mesh is built, no GPU needed; test_gpu.py trains no-shard and the one unit with
    CUDA graphs against the reference.)"""
    from types import SimpleNamespace

    from minimal_fsdp.config.flags import ConfigError, parse_args
    from minimal_fsdp.parallel import plan as plan_module

    env = SimpleNamespace(
        device=torch.device("cuda"), world_size=ranks, local_world_size=ranks, num_nodes=1
    )
    cfg = parse_args([*flags, "--compile", "--cuda_graphs"])
    monkeypatch.setattr(plan_module, "init_device_mesh", lambda *args, **kwargs: "mesh")
    tiny = make_config("gpt", "tiny", vocab_size=65)
    if not graphs:
        with pytest.raises(
            ConfigError, match="^--cuda_graphs replays the compiled model where no FSDP2 hooks"
        ):
            plan_module.make_plan(cfg, env, tiny)
        return
    plan = plan_module.make_plan(cfg, env, tiny)
    assert plan.cuda_graphs and "replayed as CUDA graphs" in plan.describe()


def test_reduce_precision_auto_sums_in_fp32_on_one_host_and_bf16_across_hosts(monkeypatch):
    """--reduce_precision auto: bf16 sums only where they cross hosts and the matmuls are bf16 or
    fp8; on one host (however many ranks) and under float32, fp32 sums."""

    def reduced(precision, world, local, asked="auto"):
        flags = ["--precision", precision, "--reduce_precision", asked]
        plan, _ = plan_for(monkeypatch, flags, world=world, local=local)
        return plan.reduce_precision, plan.reduce_dtype

    assert reduced("bf16", 4, 4) == ("float32", torch.float32)
    assert reduced("bf16", 1, 1) == ("float32", torch.float32)
    assert reduced("bf16", 4, 2) == ("bf16", torch.bfloat16)
    assert reduced("float32", 4, 2) == ("float32", torch.float32)
    # fp8 needs a GPU to plan; its choice is the same function's
    assert reduce_precision("auto", 1, "fp8") == "float32"
    assert reduce_precision("auto", 2, "fp8") == "bf16"
    assert reduced("bf16", 4, 4, asked="bf16") == ("bf16", torch.bfloat16)
