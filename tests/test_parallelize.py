"""Every sharding strategy (and offload, activation checkpointing, meta init) trains exactly like one process
holding the whole model and the whole global batch: same losses, same parameters. On 4 ranks, FSDP holds what
each strategy says (the mesh's shape and groups, sharded or gathered parameters after forward and backward),
and generated tokens are rank 0's."""
import collections
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import reference as plain
from conftest import ROOT, TINY_MODEL, launch, mpiexec

sys.path.insert(0, str(ROOT))
from minimal_fsdp import checkpoint_find, safe_load  # noqa: E402
from minimal_fsdp.llama import Llama  # noqa: E402
from minimal_fsdp.model import GPT, GPTConfig  # noqa: E402
from minimal_fsdp.models import make_config  # noqa: E402
from minimal_fsdp.parallelize import recomputed  # noqa: E402
from minimal_fsdp.train import build_optimizer  # noqa: E402

STEPS = 6


def train_args(corpus, run_name, extra=()):
    work = corpus.parent
    return ["--dataset", "text", "--input_file", corpus, "--data_dir", work / "data", "--log_dir", work / "logs",
            "--checkpoint_dir", work / "checkpoints", *TINY_MODEL, "--max_steps", STEPS, "--log_interval", 1,
            "--eval_interval", 0, "--run_name", run_name, "--lr", "3e-3", "--warmup_steps", 2,
            "--dropout", "0.0", *extra]


def reference(args, world, device="cpu", steps=STEPS):
    """The same training in one process, plain PyTorch (reference.py): whole model, all ranks' batches
    concatenated. Initial weights are drawn on `device` (CPU and CUDA generators differ), so compare on the
    same kind."""
    _, _, model, losses = plain.train(args, world, device, steps)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def logged_losses(cwd, run_name):
    rows = [json.loads(line) for line in (cwd / "logs" / run_name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


CASES = [
    (2, ["--sharding", "full-shard"]),
    (2, ["--sharding", "grad-shard"]),
    (2, ["--sharding", "no-shard", "--grad_accum_steps", 2]),  # the unit on (2 x 1): one all-reduce, after the last
    (4, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2]),
    (4, ["--sharding", "hybrid-grad-shard", "--shard_group_size", 2]),
    (2, ["--sharding", "full-shard", "--cpu_offload"]),
    (2, ["--sharding", "full-shard", "--activation_checkpoints"]),
    (2, ["--sharding", "grad-shard", "--activation_checkpoints", "--recompute", "selective"]),
    (2, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2, "--meta_init"]),
    (2, ["--sharding", "full-shard", "--grad_accum_steps", 2]),
    (2, ["--sharding", "grad-shard", "--grad_accum_steps", 3]),  # parameters stay gathered between micro-steps
    # The cases above gather this tiny model whole (--fsdp_unit auto); large models go block by block.
    (2, ["--sharding", "full-shard", "--fsdp_unit", "block", "--grad_accum_steps", 2]),
    (4, ["--sharding", "hybrid-grad-shard", "--shard_group_size", 2, "--fsdp_unit", "block"]),
    (2, ["--sharding", "full-shard", "--fsdp_unit", "block", "--activation_checkpoints", "--meta_init"]),
    (2, ["--sharding", "no-shard", "--fsdp_unit", "block", "--grad_accum_steps", 2]),  # DDP, on the last micro-step
]


@pytest.mark.slow
@pytest.mark.parametrize("ranks,extra", CASES, ids=[" ".join(map(str, e)) for _, e in CASES])
def test_strategy_matches_single_process(tmp_path, corpus, ranks, extra):
    args = train_args(corpus, "run", extra)
    launch(args, ranks=ranks, cwd=tmp_path)
    losses = logged_losses(tmp_path, "run")
    ref_losses, ref_state = reference(args, ranks)
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, abs=5e-6), (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]  # it learned something, so the comparison is not vacuous
    saved = safe_load.load_full_model_state(checkpoint_find.latest(tmp_path / "checkpoints" / "run"))
    assert saved.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """What sharding_ranks.py recorded on each of 4 ranks (one launch for every test below)."""
    out = tmp_path_factory.mktemp("sharding_ranks")
    cmd = [mpiexec(), "-n", "4", sys.executable, str(ROOT / "tests" / "sharding_ranks.py"), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(4)]


# sharding -> (mesh shape, shard group of rank r, whether blocks reshard after forward), on 4 ranks
# "-model": the whole model is one FSDP unit (--fsdp_unit model, or auto for a model this small), which stays
# gathered from forward to backward whatever the strategy (backward would gather it again at once).
MECHANISM = {
    "full-shard": ([4], lambda r: [0, 1, 2, 3], True),
    "grad-shard": ([4], lambda r: [0, 1, 2, 3], False),
    "hybrid-full-shard": ([2, 2], lambda r: [r // 2 * 2, r // 2 * 2 + 1], True),  # --shard_group_size 2
    "hybrid-grad-shard": ([2, 2], lambda r: [r // 2 * 2, r // 2 * 2 + 1], False),
    "hybrid-full-shard-4": ([1, 4], lambda r: [0, 1, 2, 3], True),  # --shard_group_size 4
    "full-shard-model": ([4], lambda r: [0, 1, 2, 3], True),
    "grad-shard-model": ([4], lambda r: [0, 1, 2, 3], False),
    "hybrid-full-shard-model": ([2, 2], lambda r: [r // 2 * 2, r // 2 * 2 + 1], True),
    "no-shard-model": ([4, 1], lambda r: [r], False),  # whole_unit.py's replicas: each rank its own "shard"
}


@pytest.mark.parametrize("sharding", MECHANISM)
def test_fsdp_holds_what_the_strategy_says(four_ranks, sharding):
    """Mesh: (replicate x shard) with this rank's shard group; parameters: rank r keeps its torch.chunk rows of
    every weight (uneven: vocab 42 -> 11, 11, 11, 9), gathered whole from forward to backward unless the
    strategy reshards after forward (every block but the last, which backward needs at once; as one unit, none).
    As one unit, the root has gathered every block before the first block's forward begins."""
    shape, shard_group, reshards = MECHANISM[sharding]
    whole = sharding.endswith("-model")
    for rank, result in enumerate(four_ranks):
        state = result["shardings"][sharding]
        group = shard_group(rank)
        assert state["mesh"] == shape and state["groups"]["shard"] == group, (rank, state)
        assert state["dims"] == (["replicate", "shard"] if len(shape) == 2 else ["shard"])
        if len(shape) == 2:  # the same shard position in every group
            assert state["groups"]["replicate"] == [r for r in range(4) if shard_group(r).index(r) == group.index(rank)]
        position, parts = group.index(rank), len(group)
        qkv = [len(torch.arange(48).chunk(parts)[position]), 16]
        sharded = [True, qkv]
        gathered = [False, [48, 16]]
        assert state["whole_model_unit"] == whole, rank
        after_forward = [gathered] * 3 if whole else [sharded if reshards else gathered] * 2 + [gathered]
        assert state["after_forward"]["blocks"] == after_forward, rank
        assert state["after_backward"]["blocks"] == [sharded] * 3, rank
        assert state["after_backward"]["wte"] == [len(torch.arange(42).chunk(parts)[position]), 16]


def test_no_shard_of_units_per_block_is_ddp_on_whole_models(four_ranks):
    """no-shard of a model too large for one unit (here --fsdp_unit block): every rank holds whole, plain
    parameters and, after backward on its own batch, the same (averaged) gradient: DDP's all-reduce ran. The
    single-process comparison (test_strategy_matches_single_process) checks that it is the average. The gradients
    are views of DDP's buckets, not copies of them (a step faster on GPUs)."""
    states = [result["shardings"]["no-shard-block"] for result in four_ranks]
    assert all(s["ddp"] and s["mesh"] is None for s in states)
    assert all(s["after_backward"] == {"blocks": [[False, [48, 16]]] * 3, "wte": [42, 16]} for s in states)
    assert len({s["loss"] for s in states}) == 4  # four different batches
    assert all(s["grad"] == states[0]["grad"] for s in states) and any(states[0]["grad"])
    assert all(s["grads_are_views"] for s in states)


def test_generated_tokens_come_from_rank_0(four_ranks):
    """Every rank's weights got different noise, so each rank alone would pick other tokens; generate() has
    them all continue with rank 0's choice."""
    texts = [result["generation"]["text"] for result in four_ranks]
    own = [result["generation"]["own"] for result in four_ranks]
    assert len(set(own)) > 1, own  # the ranks' logits do differ
    assert texts == [own[0]] * 4, (texts, own)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_cls", [GPT, Llama])
def test_recompute_policies_recompute_what_they_say(model_cls):
    """Backward of a checkpointed block reruns forward ops: full reruns the matmuls too, selective only the
    norms and activations. Gradients are the same in every case."""
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
    norm = "native_layer_norm" if model_cls is GPT else "rsqrt"  # a forward-only op of each model's norm
    assert counts["none"][norm] == 0
    assert counts["full"][norm] > 0 and counts["selective"][norm] > 0
    matmuls = {policy: c["mm"] + c["addmm"] for policy, c in counts.items()}
    assert matmuls["selective"] == matmuls["none"]  # matmul outputs were kept
    assert matmuls["full"] > matmuls["none"]  # ...and recomputed under full


@pytest.mark.parametrize("stays_gathered", [True, False])
def test_accumulation_gathers_parameters_once_where_they_stay_gathered(one_rank_group, stays_gathered):
    """Over one rank nothing reshards after forward, so the micro-steps after the first find the parameters
    still gathered; only the last micro-step reshards them for the optimizer. Turned off, every micro-step
    gathers them again (the control that shows the test can see the difference)."""
    from types import SimpleNamespace
    from torch.distributed.tensor import DTensor
    from minimal_fsdp.config import Config
    import dataclasses
    from minimal_fsdp.parallelize import build_model, gradient_sync
    from minimal_fsdp.plan import make_plan
    from minimal_fsdp.train import train_step
    cfg = Config(sharding="full-shard", fsdp_unit="block")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the group is NCCL where CUDA is
    env = SimpleNamespace(device=device, world_size=1, local_world_size=1)
    config = GPTConfig(vocab_size=64, seq_length=16, num_layers=2, num_heads=2, embed_size=16)
    plan = make_plan(cfg, env, config, fsdp_on_one_rank=True)
    assert plan.strategy == "fsdp-block" and plan.stays_gathered  # one rank: no reshard after forward
    model = build_model(GPT, config, plan, env, cfg.seed)
    if not stays_gathered:
        plan = dataclasses.replace(plan, reshard_after_forward=True)  # what FSDPSync reads
    sharded_at_forward = []
    for block in model.blocks:  # runs before FSDP's own pre-forward hook, which gathers
        block.register_forward_pre_hook(
            lambda module, args: sharded_at_forward.append(isinstance(module.attn.qkv.weight, DTensor)),
            prepend=True)
    x = torch.randint(0, 64, (2, 16), device=device)
    train_step(model, build_optimizer(model, cfg), [(x, x)] * 3, gradient_sync(model, plan), 1.0, env.device)
    first, later = sharded_at_forward[:2], sharded_at_forward[2:]
    assert first == [True, True] and later == [not stays_gathered] * 4
    assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded after the last micro-step


@pytest.mark.parametrize("flags,ranks,graphs", [(["--sharding", "full-shard"], 1, True),
                                               (["--sharding", "no-shard"], 2, True),
                                               (["--sharding", "no-shard", "--fsdp_unit", "block"], 2, True),  # DDP
                                               (["--sharding", "full-shard"], 2, True),  # one unit: whole_unit.py
                                               (["--sharding", "grad-shard"], 2, True),
                                               (["--sharding", "full-shard", "--fsdp_unit", "block"], 2, False),
                                               (["--sharding", "full-shard", "--cpu_offload"], 2, False)])
def test_cuda_graphs_only_where_no_fsdp_hooks_surround_the_graph(monkeypatch, flags, ranks, graphs):
    """--cuda_graphs replays the compiled model: on one rank, under DDP (its all-reduce runs outside the graphs,
    on the gradients backward leaves) and as whole_unit.py's one unit (its parameters keep their addresses).
    FSDP2 frees and re-gathers the parameters each step at new addresses, which a replayed graph would not see:
    asked for there, it is refused in one line, not dropped. (Plans only: no mesh is built, no GPU needed;
    test_gpu.py trains no-shard and the one unit with CUDA graphs against the reference.)"""
    from types import SimpleNamespace
    from minimal_fsdp import plan as plan_module
    from minimal_fsdp.config import ConfigError, parse_args
    env = SimpleNamespace(device=torch.device("cuda"), world_size=ranks, local_world_size=ranks)
    cfg = parse_args([*flags, "--compile", "--cuda_graphs"])
    monkeypatch.setattr(plan_module, "init_device_mesh", lambda *args, **kwargs: "mesh")
    tiny = make_config("gpt", "tiny", vocab_size=65)
    if not graphs:
        with pytest.raises(ConfigError, match="^--cuda_graphs replays the compiled model where no FSDP2 hooks"):
            plan_module.make_plan(cfg, env, tiny)
        return
    plan = plan_module.make_plan(cfg, env, tiny)
    assert plan.cuda_graphs and "replayed as CUDA graphs" in plan.describe()
