"""parallelize.py: every sharding strategy (and offload, activation checkpointing, meta init) trains
exactly like one process holding the whole model and the whole global batch: same losses, same
parameters. On 4 ranks, FSDP holds what each strategy says (the mesh's shape and groups, sharded or
gathered parameters after forward and backward), and generated tokens are rank 0's. In this process
(fast, and what mutation testing can see): what shard() hands to FSDP2 (units, resharding, mixed
precision, offload), what build_model compiles, which gradient sync a plan gets and how each clips,
initial weights on every path, the recompute policies, and the process-wide settings a plan needs.
The plan itself (plan.py) is test_plan.py's."""

import collections
import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from minimal_fsdp.checkpoint import find, safe_load
from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.config.sections import Optimizer
from minimal_fsdp.models.families import make_config
from minimal_fsdp.models.gpt import GPT, GPTConfig
from minimal_fsdp.models.llama import Llama
from minimal_fsdp.parallel import choose, parallelize
from minimal_fsdp.parallel import plan as plan_module
from minimal_fsdp.parallel.gossip import Gossip
from minimal_fsdp.parallel.parallelize import (
    SYNCS,
    DDPSync,
    FSDPSync,
    LocalSync,
    WholeUnitSync,
    build_model,
    gradient_sync,
    recomputed,
    shard,
)
from minimal_fsdp.parallel.plan import (
    STRATEGIES,
    apply_process_settings,
    make_plan,
    process_settings,
)
from minimal_fsdp.parallel.whole_unit import WholeUnit
from minimal_fsdp.train import build_optimizer

from conftest import ROOT, launch_runs, make_text, mpiexec
from support import (
    CONFIG,
    NUM_PARAMS,
    REDUCE_CASES,
    STEPS,
    check_reduce_precision,
    logged_losses,
    plain_plan,
    reference,
    run_reduce_ranks,
    train_args,
)

CASES = [
    (2, ["--sharding", "full-shard"]),
    (2, ["--sharding", "grad-shard"]),
    # the unit on (2 x 1): one all-reduce, after the last
    (2, ["--sharding", "no-shard", "--grad_accum_steps", 2]),
    (4, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2]),
    (4, ["--sharding", "hybrid-grad-shard", "--shard_group_size", 2]),
    (2, ["--sharding", "full-shard", "--cpu_offload"]),
    (2, ["--sharding", "full-shard", "--activation_checkpoints"]),
    (2, ["--sharding", "grad-shard", "--activation_checkpoints", "--recompute", "selective"]),
    (2, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2, "--meta_init"]),
    (2, ["--sharding", "full-shard", "--grad_accum_steps", 2]),
    # parameters stay gathered between micro-steps
    (2, ["--sharding", "grad-shard", "--grad_accum_steps", 3]),
    # The cases above gather this tiny model whole (--fsdp_unit auto); large models go block
    # by block.
    (2, ["--sharding", "full-shard", "--fsdp_unit", "block", "--grad_accum_steps", 2]),
    (4, ["--sharding", "hybrid-grad-shard", "--shard_group_size", 2, "--fsdp_unit", "block"]),
    (
        2,
        [
            "--sharding",
            "full-shard",
            "--fsdp_unit",
            "block",
            "--activation_checkpoints",
            "--meta_init",
        ],
    ),
    # DDP, on the last micro-step
    (2, ["--sharding", "no-shard", "--fsdp_unit", "block", "--grad_accum_steps", 2]),
]


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    """Every selected case trained by the real entry point, each in its own directory with its own
    corpus; the cases of one world size one after the other in one launch (tests/several_runs.py: 2
    launches, not 15)."""
    selected = {
        CASES.index((item.callspec.params["ranks"], item.callspec.params["extra"]))
        for item in request.session.items
        if item.originalname == "test_strategy_matches_single_process"
    }
    runs = {}
    for ranks in sorted({ranks for ranks, _ in CASES}):
        flags = []
        for case, (world, extra) in enumerate(CASES):
            if world == ranks and case in selected:
                work = tmp_path_factory.mktemp(f"case_{case}")
                (work / "corpus.txt").write_text(make_text())
                runs[case] = work, train_args(work / "corpus.txt", "run", extra)
                flags.append(runs[case][1])
        if flags:
            launch_runs(flags, ranks)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("ranks,extra", CASES, ids=[" ".join(map(str, e)) for _, e in CASES])
def test_strategy_matches_single_process(trained, ranks, extra):
    work, args = trained[CASES.index((ranks, extra))]
    losses = logged_losses(work, "run")
    ref_losses, ref_state = reference(args, ranks)
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, abs=5e-6), (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]  # it learned something, so the comparison is not vacuous
    saved = safe_load.load_full_model_state(find.latest(work / "checkpoints" / "run"))
    assert saved.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """What sharding_ranks.py recorded on each of 4 ranks (one launch for every test below)."""
    out = tmp_path_factory.mktemp("sharding_ranks")
    cmd = [
        mpiexec(),
        "-n",
        "4",
        sys.executable,
        str(ROOT / "tests" / "sharding_ranks.py"),
        str(out),
    ]
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(4)]


# sharding -> (mesh shape, shard group of rank r, whether blocks reshard after forward), on 4 ranks
# "-model": the whole model is one FSDP unit (--fsdp_unit model, or auto for a model this small),
# which stays gathered from forward to backward whatever the strategy (backward would gather it
# again at once).
MECHANISM = {
    "full-shard": ([4], lambda r: [0, 1, 2, 3], True),
    "grad-shard": ([4], lambda r: [0, 1, 2, 3], False),
    # --shard_group_size 2
    "hybrid-full-shard": ([2, 2], lambda r: [r // 2 * 2, r // 2 * 2 + 1], True),
    "hybrid-grad-shard": ([2, 2], lambda r: [r // 2 * 2, r // 2 * 2 + 1], False),
    "hybrid-full-shard-4": ([1, 4], lambda r: [0, 1, 2, 3], True),  # --shard_group_size 4
    "full-shard-model": ([4], lambda r: [0, 1, 2, 3], True),
    "grad-shard-model": ([4], lambda r: [0, 1, 2, 3], False),
    "hybrid-full-shard-model": ([2, 2], lambda r: [r // 2 * 2, r // 2 * 2 + 1], True),
    # whole_unit.py's replicas: each rank its own "shard"
    "no-shard-model": ([4, 1], lambda r: [r], False),
}


@pytest.mark.parametrize("sharding", MECHANISM)
def test_fsdp_holds_what_the_strategy_says(four_ranks, sharding):
    """Mesh: (replicate x shard) with this rank's shard group; parameters: rank r keeps its
    torch.chunk rows of every weight (uneven: vocab 42 -> 11, 11, 11, 9), gathered whole from
    forward to backward unless the strategy reshards after forward (every block but the last, which
    backward needs at once; as one unit, none). As one unit, the root has gathered every block
    before the first block's forward begins."""
    shape, shard_group, reshards = MECHANISM[sharding]
    whole = sharding.endswith("-model")
    for rank, result in enumerate(four_ranks):
        state = result["shardings"][sharding]
        group = shard_group(rank)
        assert state["mesh"] == shape and state["groups"]["shard"] == group, (rank, state)
        assert state["dims"] == (["replicate", "shard"] if len(shape) == 2 else ["shard"])
        if len(shape) == 2:  # the same shard position in every group
            assert state["groups"]["replicate"] == [
                r for r in range(4) if shard_group(r).index(r) == group.index(rank)
            ]
        position, parts = group.index(rank), len(group)
        qkv = [len(torch.arange(48).chunk(parts)[position]), 16]
        sharded = [True, qkv]
        gathered = [False, [48, 16]]
        assert state["whole_model_unit"] == whole, rank
        after_forward = (
            [gathered] * 3 if whole else [sharded if reshards else gathered] * 2 + [gathered]
        )
        assert state["after_forward"]["blocks"] == after_forward, rank
        assert state["after_backward"]["blocks"] == [sharded] * 3, rank
        assert state["after_backward"]["wte"] == [len(torch.arange(42).chunk(parts)[position]), 16]


def test_no_shard_of_units_per_block_is_ddp_on_whole_models(four_ranks):
    """no-shard of a model too large for one unit (here --fsdp_unit block): every rank holds whole,
    plain parameters and, after backward on its own batch, the same (averaged) gradient: DDP's
    all-reduce ran. The single-process comparison (test_strategy_matches_single_process) checks that
    it is the average. The gradients are views of DDP's buckets, not copies of them (a step faster
    on GPUs)."""
    states = [result["shardings"]["no-shard-block"] for result in four_ranks]
    assert all(s["ddp"] and s["mesh"] is None for s in states)
    assert all(
        s["after_backward"] == {"blocks": [[False, [48, 16]]] * 3, "wte": [42, 16]} for s in states
    )
    assert len({s["loss"] for s in states}) == 4  # four different batches
    assert all(s["grad"] == states[0]["grad"] for s in states) and any(states[0]["grad"])
    assert all(s["grads_are_views"] for s in states)


def test_generated_tokens_come_from_rank_0(four_ranks):
    """Every rank's weights got different noise, so each rank alone would pick other tokens;
    generate() has them all continue with rank 0's choice."""
    texts = [result["generation"]["text"] for result in four_ranks]
    own = [result["generation"]["own"] for result in four_ranks]
    assert len(set(own)) > 1, own  # the ranks' logits do differ
    assert texts == [own[0]] * 4, (texts, own)


@pytest.fixture(scope="module")
def reduced_on_four_ranks(tmp_path_factory):
    return run_reduce_ranks(tmp_path_factory.mktemp("reduce_ranks"), 4)


# reduce_ranks.py's 4-rank launch: the full tier (the quick tier's: sharding_ranks.py's)
@pytest.mark.slow
@pytest.mark.parametrize("case", REDUCE_CASES)
def test_reduce_precision_bf16_sums_the_gradients_in_bf16(reduced_on_four_ranks, case):
    """--reduce_precision bf16 under every strategy that sums gradients (FSDP2's reduce-scatter,
    hybrid's all-reduce too, the one unit's, DDP's hook): every rank gets the same gradients, each
    exactly a bf16 value (the sum was taken in bf16; divided by 4 ranks, exact), within bf16's
    rounding of the fp32 sums. With float32 they are not bf16 values: the flag is what changed the
    collective's dtype. (test_gpu.py: the same over NCCL.)"""
    check_reduce_precision([result[case] for result in reduced_on_four_ranks], case)


@pytest.mark.slow  # reduce_ranks.py's launch, as above
@pytest.mark.parametrize("case", [case for case in REDUCE_CASES if "bf16" not in case])
def test_the_reduced_gradient_is_the_mean_of_the_ranks_own_gradients(reduced_on_four_ranks, case):
    """The gradient every strategy leaves is the mean of the ranks' own gradients, each computed by
    reduce_ranks.py on a plain fp32 copy of the weights (no process group). The bf16 comparison
    above passes a gradient left undivided by the world size (both precisions wrong alike), and
    AdamW hides such a constant scale from the losses; bf16 compute is left out (other gradients,
    not a mean's)."""
    own = [
        {name: torch.tensor(g) for name, g in rank[case]["float32"]["own"].items()}
        for rank in reduced_on_four_ranks
    ]
    mean = {name: sum(g[name] for g in own) / len(own) for name in own[0]}
    assert any(not torch.allclose(mean[name], own[0][name]) for name in mean)  # the batches differ
    synced = reduced_on_four_ranks[0][case]["float32"]["grads"]
    assert synced.keys() == mean.keys()
    for name, expected in mean.items():  # a sum instead of the mean is off by a factor of 4
        torch.testing.assert_close(
            torch.tensor(synced[name]), expected, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}"
        )


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_cls", [GPT, Llama])
def test_recompute_policies_recompute_what_they_say(model_cls):
    """Backward of a checkpointed block reruns forward ops: full reruns the matmuls too, selective
    only the norms and activations. Gradients are the same in every case."""
    torch.manual_seed(0)
    model = model_cls(make_config("gpt" if model_cls is GPT else "llama", "tiny"))
    x, y = torch.randint(60, (2, 16)), torch.randint(60, (2, 16))
    counts, grads = {}, {}
    plain = [block.forward for block in model.blocks]
    for policy in ("none", "full", "selective"):
        for block, forward in zip(model.blocks, plain):
            block.forward = forward if policy == "none" else recomputed(forward, policy)
        model.zero_grad()
        loss = model(x, y)
        with CountOps() as ops:
            loss.backward()
        counts[policy], grads[policy] = ops.counts, [p.grad.clone() for p in model.parameters()]
    for policy in ("full", "selective"):
        for a, b in zip(grads["none"], grads[policy]):
            torch.testing.assert_close(a, b)
    # a forward-only op of each model's norm
    norm = "native_layer_norm" if model_cls is GPT else "rsqrt"
    assert counts["none"][norm] == 0
    assert counts["full"][norm] > 0 and counts["selective"][norm] > 0
    matmuls = {policy: c["mm"] + c["addmm"] for policy, c in counts.items()}
    assert matmuls["selective"] == matmuls["none"]  # matmul outputs were kept
    assert matmuls["full"] > matmuls["none"]  # ...and recomputed under full


@pytest.mark.parametrize("stays_gathered", [True, False])
def test_accumulation_gathers_parameters_once_where_they_stay_gathered(
    one_rank_group, stays_gathered
):
    """Over one rank nothing reshards after forward, so the micro-steps after the first find the
    parameters still gathered; only the last micro-step reshards them for the optimizer. Turned off,
    every micro-step gathers them again (the control that shows the test can see the difference)."""
    import dataclasses
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    from minimal_fsdp.config.flags import Config
    from minimal_fsdp.parallel.parallelize import build_model, gradient_sync
    from minimal_fsdp.parallel.plan import make_plan
    from minimal_fsdp.train import train_step

    cfg = Config(sharding="full-shard", fsdp_unit="block")
    # the group is NCCL where CUDA is
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = SimpleNamespace(device=device, world_size=1, local_world_size=1, num_nodes=1)
    config = GPTConfig(vocab_size=64, seq_length=16, num_layers=2, num_heads=2, embed_size=16)
    plan = make_plan(cfg, env, config, fsdp_on_one_rank=True)
    # one rank: no reshard after forward
    assert plan.strategy == "fsdp-block" and plan.stays_gathered
    model = build_model(GPT, config, plan, env, cfg.seed)
    if not stays_gathered:
        plan = dataclasses.replace(plan, reshard_after_forward=True)  # what FSDPSync reads
    sharded_at_forward = []
    for block in model.blocks:  # runs before FSDP's own pre-forward hook, which gathers
        block.register_forward_pre_hook(
            lambda module, args: sharded_at_forward.append(
                isinstance(module.attn.qkv.weight, DTensor)
            ),
            prepend=True,
        )
    x = torch.randint(0, 64, (2, 16), device=device)
    train_step(
        model,
        build_optimizer(model, Optimizer.of(cfg)),
        [(x, x)] * 3,
        gradient_sync(model, plan),
        1.0,
        env.device,
    )
    first, later = sharded_at_forward[:2], sharded_at_forward[2:]
    assert first == [True, True] and later == [not stays_gathered] * 4
    # resharded after the last micro-step
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_build_model_refuses_a_plan_made_for_another_model():
    with pytest.raises(ValueError, match="make_plan with this model's config"):
        build_model(
            GPT, CONFIG, plain_plan(strategy="local", num_params=NUM_PARAMS + 1), CPU, seed=0
        )


@pytest.fixture
def group(one_rank_group):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))


@pytest.mark.parametrize("whole", [False, True])
def test_shard_makes_the_units_it_is_asked_for(group, whole):
    """Per block: every block its own FSDP unit, resharded after forward but the last, and the root
    not (backward gathers it again at once); whole: the root alone, never resharded after forward.
    bf16 gathers in bf16 and reduces in fp32 (--reduce_precision bf16: in bf16); float32 gathers
    fp32; offload keeps shards on the CPU."""
    strategy = "fsdp-whole" if whole else "fsdp-block"
    plan = plain_plan(strategy=strategy, mesh=group, cpu_offload=True)
    model = shard(GPT(CONFIG), plan)
    assert isinstance(model, FSDPModule)
    assert [isinstance(b, FSDPModule) for b in model.blocks] == [not whole] * 3
    root = model._get_fsdp_state()
    states = [root] + ([] if whole else [b._get_fsdp_state() for b in model.blocks])
    reshards = [s._fsdp_param_group.post_forward_mesh_info is not None for s in states]
    assert reshards == ([False] if whole else [False, True, True, False])
    for state in states:
        assert state._fsdp_param_group.mesh_info.mesh is group  # the plan's mesh, not a default one
        assert (
            state._mp_policy.param_dtype == torch.bfloat16
            and state._mp_policy.reduce_dtype == torch.float32
        )
        offload = state._fsdp_param_group.offload_policy
        assert (
            isinstance(offload, CPUOffloadPolicy)
            and offload.pin_memory is torch.cuda.is_available()
        )
    fp32 = shard(
        GPT(CONFIG), plain_plan(strategy=strategy, mesh=group, precision="float32")
    )._get_fsdp_state()
    assert fp32._mp_policy.param_dtype is None and fp32._mp_policy.reduce_dtype == torch.float32
    assert not isinstance(fp32._fsdp_param_group.offload_policy, CPUOffloadPolicy)
    for precision in ("bf16", "float32"):
        plan = plain_plan(
            strategy=strategy, mesh=group, precision=precision, reduce_precision="bf16"
        )
        assert shard(GPT(CONFIG), plan)._get_fsdp_state()._mp_policy.reduce_dtype == torch.bfloat16


@pytest.mark.parametrize("reshard", [True, False])
def test_an_untied_models_embedding_and_head_are_units_of_their_own(group, reshard):
    """Llama (untied): the embedding and the output head are FSDP units beside the blocks. In a
    training step the head and the root stay gathered from forward to backward, the embedding and
    the blocks reshard as the sharding says, every gradient reaches its shard, and the loss and
    gradients are the unsharded model's."""
    from torch.distributed.tensor import DTensor

    from support import HF_LLAMA

    torch.manual_seed(0)
    reference = Llama(HF_LLAMA)
    model = Llama(HF_LLAMA)
    model.load_state_dict(reference.state_dict())
    plan = plain_plan(
        strategy="fsdp-block", mesh=group, precision="float32", reshard_after_forward=reshard
    )
    shard(model, plan)
    assert isinstance(model.wte, FSDPModule) and isinstance(model.lm_head, FSDPModule)
    states = {
        "root": model._get_fsdp_state(),
        "wte": model.wte._get_fsdp_state(),
        "lm_head": model.lm_head._get_fsdp_state(),
    }
    # the root keeps only the final norm
    ((held,),) = [states["root"]._fsdp_param_group.fsdp_params]
    assert held._module_info.module is model.norm
    reshards = {
        k: s._fsdp_param_group.post_forward_mesh_info is not None for k, s in states.items()
    }
    assert reshards == {"root": False, "wte": reshard, "lm_head": False}
    x = torch.randint(0, HF_LLAMA.vocab_size, (2, HF_LLAMA.seq_length))
    loss = model(x, x)
    # between forward and backward: what stays gathered is a plain tensor, a resharded one a DTensor
    assert not isinstance(model.lm_head.weight, DTensor) and not isinstance(
        model.norm.weight, DTensor
    )
    assert isinstance(model.wte.weight, DTensor) is reshard
    assert isinstance(model.blocks[0].attn_norm.weight, DTensor) is reshard
    loss.backward()
    expected = reference(x, x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert grads.keys() == {n for n, _ in reference.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    # inference: the head gives the last position's logits
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


@pytest.mark.parametrize("strategy", ["fsdp-block", "fsdp-whole", "one-unit"])
def test_build_model_compiles_per_block_or_whole(group, strategy):
    plan = plain_plan(strategy=strategy, mesh=group, compile=True, reshard_after_forward=False)
    model = build_model(GPT, CONFIG, plan, SimpleNamespace(device=torch.device("cpu")), seed=0)
    compiled_blocks = [
        getattr(b.forward, "__wrapped__", None) == type(b).forward.__get__(b) for b in model.blocks
    ]
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
    calls = record_calls(
        monkeypatch, parallelize.torch, "autocast", lambda *args, **kwargs: lambda f: f
    )
    build_model(GPT, CONFIG, plain_plan(strategy="local", precision="bf16"), CPU, seed=0)
    assert calls == [(("cpu",), {"dtype": torch.bfloat16})]
    calls.clear()
    build_model(GPT, CONFIG, plain_plan(strategy="local", precision="float32"), CPU, seed=0)
    assert calls == []


def test_ddp_replicates_the_model_without_rebroadcasting_buffers(monkeypatch):
    calls = record_calls(monkeypatch, parallelize, "replicate")
    ddp = plain_plan(strategy="ddp", precision="float32")
    model = build_model(GPT, CONFIG, ddp, CPU, seed=0)
    assert calls == [
        (
            (model,),
            {
                "device_id": torch.device("cpu"),
                "broadcast_buffers": False,
                "gradient_as_bucket_view": True,
            },
        )
    ]
    assert type(gradient_sync(model, ddp)) is DDPSync
    assert gradient_sync(model, ddp).model is model


@pytest.mark.parametrize("graphs", [True, False])
def test_ddp_with_graphs_compiles_one_graph_not_one_per_bucket(monkeypatch, graphs):
    """Under DDP, Dynamo cuts a compiled model at DDP's buckets (recipe S: 3 graphs, each replayed
    and run through autograd on its own); a model replayed as CUDA graphs is host-bound, so it stays
    one graph. The setting is process-wide: the plan names it, run.parallel_plan applies it at the
    start of the run, build_model leaves it alone."""
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


def test_compiled_float8_layers_turn_off_inductors_mix_order_reductions():
    """Compiled with float8 layers, the plan turns off inductor's mix-order reductions (a norm's
    backward fused with the float8 casts around it ran 3x slower at Llama 3 8B's shape); without
    float8, or uncompiled, it leaves inductor as it is."""
    import torch._inductor.config as inductor

    if not hasattr(inductor.triton, "mix_order_reduction"):
        pytest.skip("this torch has no mix-order reductions")
    name = "torch._inductor.config.triton.mix_order_reduction"
    fp8 = plain_plan(strategy="local", compile=True, fp8="tensorwise")
    assert process_settings(fp8) == {name: False}
    assert process_settings(dataclasses.replace(fp8, fp8="rowwise")) == {name: False}
    assert process_settings(dataclasses.replace(fp8, fp8=None)) == {}
    assert process_settings(dataclasses.replace(fp8, compile=False)) == {}
    with inductor.patch({"triton.mix_order_reduction": True}):  # restored afterwards
        apply_process_settings(fp8)
        assert inductor.triton.mix_order_reduction is False


@pytest.mark.parametrize("graphs", [False, True])
def test_the_whole_trunk_is_compiled_and_replayed_as_graphs_as_planned(monkeypatch, graphs):
    calls = record_calls(
        monkeypatch, parallelize, "compiled_unless_caching", lambda f, mode=None: f
    )
    model = build_model(
        GPT, CONFIG, plain_plan(strategy="local", compile=True, cuda_graphs=graphs), CPU, seed=0
    )
    ((args, kwargs),) = calls
    assert args == (model.trunk, "reduce-overhead" if graphs else None) and kwargs == {}
    # the loss compiled too (CPU: no fused kernel)
    assert hasattr(model.loss, "_torchdynamo_orig_callable")


def test_uncompiled_models_keep_their_eager_loss():
    from minimal_fsdp.models.layers import cross_entropy

    model = build_model(GPT, CONFIG, plain_plan(strategy="local"), CPU, seed=0)
    assert model.loss is cross_entropy and not hasattr(model.trunk, "__wrapped__")


def test_generation_runs_the_eager_function_and_training_the_compiled_one(monkeypatch):
    modes = record_calls(
        monkeypatch,
        parallelize.torch,
        "compile",
        lambda f, mode=None: lambda *a, **k: ("compiled", a),
    )
    run = parallelize.compiled_unless_caching(lambda *a, **k: ("eager", a), "reduce-overhead")
    assert modes == [((run.__wrapped__,), {"mode": "reduce-overhead"})]
    cache = parallelize.KVCache.__new__(parallelize.KVCache)
    assert (
        run(1, 2)[0] == "compiled"
        and run(1, cache)[0] == "eager"
        and run(1, cache=cache)[0] == "eager"
    )


def test_every_path_gives_the_same_initial_weights(group):
    """Plain or sharded, built on the meta device or not, offloaded or not: the weights of seed
    3."""
    plain = build_model(GPT, CONFIG, plain_plan(strategy="local"), CPU, seed=3).state_dict()
    meta = build_model(
        GPT, CONFIG, plain_plan(strategy="local", meta_init=True), CPU, seed=3
    ).state_dict()
    sharded = [
        build_model(
            GPT, CONFIG, plain_plan(mesh=group, precision="float32", **options), CPU, seed=3
        )
        for options in (
            dict(),
            dict(meta_init=True),
            dict(meta_init=True, cpu_offload=True),
            dict(strategy="one-unit"),
            dict(strategy="one-unit", meta_init=True),
        )
    ]
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
def test_the_unit_rule_counts_every_parameter_embeddings_included(
    group, monkeypatch, limit_below_total, whole
):
    monkeypatch.setattr(choose, "SMALL_MODEL", NUM_PARAMS - 1 if limit_below_total else NUM_PARAMS)
    monkeypatch.setattr(plan_module, "init_device_mesh", lambda *args, **kwargs: group)
    env = SimpleNamespace(device=torch.device("cpu"), world_size=1, local_world_size=1, num_nodes=1)
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


def test_fsdp_sync_reduces_the_norm_over_the_shard_group_and_precomputes_float8_scales(
    group, monkeypatch
):
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
    """The global norm (here one rank's) and the clipped gradients match torch's clip_grad_norm_ on
    plain copies; 0 does not clip; a norm under max_norm leaves the gradients as they are. FSDP2's
    sync (block units) and the one unit's (whole_unit.py: its shards' gradients are one tensor)."""
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
    # one all-reduce, of the norm
    assert [kwargs["group"] for _, kwargs in groups] == [group.get_group("shard")]
    # The sum of squares is taken in another order than torch's: equal to a few units in the last
    # place, well under the clip's own epsilon (1e-6 / norm) that a wrong formula would move it by.
    torch.testing.assert_close(norm, expected, rtol=3e-7, atol=0)
    for p, q in zip(model.parameters(), params):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=3e-7, atol=0)
    if max_norm == 100.0:
        assert all(torch.equal(p.grad, g) for p, g in zip(params, plain))  # not scaled up
