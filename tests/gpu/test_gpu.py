"""GPU checks (marked gpu: skipped without CUDA, never run in CI). Run on the GPU machine with
`pytest -m gpu tests/gpu/test_gpu.py`: NCCL runs of every strategy against a single-process fp32
reference on one GPU (same initial weights: the init generator runs on the training device)."""

import re

import pytest
import torch

from conftest import launch
from support import (
    REDUCE_CASES,
    check_reduce_precision,
    logged_losses,
    reference,
    run_reduce_ranks,
    sample_of,
    train_args,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

STRATEGIES = [
    ["--sharding", "full-shard"],
    ["--sharding", "grad-shard"],
    ["--sharding", "no-shard"],
    ["--sharding", "hybrid-full-shard", "--shard_group_size", 1],
    ["--sharding", "hybrid-grad-shard", "--shard_group_size", 1],
]
# The tiny model is one FSDP unit (--fsdp_unit auto): "--fsdp_unit block" runs large models' layout.
OPTIONS = [
    ["--cpu_offload"],
    ["--meta_init"],
    ["--activation_checkpoints"],
    ["--compile"],
    ["--compile", "--activation_checkpoints", "--recompute", "selective"],
    # one gathered unit replayed as graphs (by size), accumulating
    ["--compile", "--grad_accum_steps", "2"],
    ["--compile", "--fsdp_unit", "block"],
    ["--compile", "--fsdp_unit", "block", "--activation_checkpoints"],
    # no-shard: the tiny model is whole_unit.py's unit on each replica, one all-reduce a step (its
    # compiled model replayed as graphs: asked for, then by size, accumulating); large models' DDP,
    # graphs asked for.
    ["--sharding", "no-shard", "--compile", "--cuda_graphs"],
    ["--sharding", "no-shard", "--compile", "--grad_accum_steps", "2"],
    ["--sharding", "no-shard", "--fsdp_unit", "block", "--compile", "--cuda_graphs"],
]
# fp32 differs from the CPU only by kernel summation order; bf16 rounds every matmul input.
TOLERANCE = {"float32": dict(abs=2e-4), "bf16": dict(rel=2e-2)}


def check_against_reference(tmp_path, corpus, extra, precision, run_name="run"):
    args = train_args(corpus, run_name, [*extra, "--precision", precision])
    launch(args, ranks=2, cwd=tmp_path)
    losses = logged_losses(corpus.parent, run_name)
    ref_losses, _ = reference(args, world=2, device="cuda")
    assert losses == pytest.approx(ref_losses, **TOLERANCE[precision]), (losses, ref_losses)
    return losses


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: " ".join(map(str, s)))
def test_nccl_strategy_matches_cpu_reference(tmp_path, corpus, strategy, precision):
    check_against_reference(tmp_path, corpus, strategy, precision)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: " ".join(o))
def test_nccl_options_match_cpu_reference(tmp_path, corpus, option):
    check_against_reference(tmp_path, corpus, option, "bf16")


def test_compile_on_and_off_agree(tmp_path, corpus):
    off = check_against_reference(tmp_path, corpus, [], "float32", run_name="eager")
    on = check_against_reference(tmp_path, corpus, ["--compile"], "float32", run_name="compiled")
    assert on == pytest.approx(off, abs=2e-4)


def test_generation_only_on_one_and_two_gpus(tmp_path, corpus):
    launch(train_args(corpus, "shakespeare", ["--precision", "bf16"]), ranks=2, cwd=tmp_path)
    gen = [
        "--max_epochs",
        -1,
        "--checkpoint_dir",
        tmp_path / "checkpoints",
        "--num_tokens",
        64,
        "--seed",
        5,
    ]
    one = sample_of(launch(gen, ranks=1, cwd=tmp_path).stdout)
    two = sample_of(launch([*gen, "--sharding", "grad-shard"], ranks=2, cwd=tmp_path).stdout)
    assert len(one) == len("ROMEO:") + 64 and one == two


@pytest.mark.parametrize(
    "extra,precision",
    [
        ([], "float32"),
        ([], "bf16"),
        (["--compile"], "float32"),
        (["--compile", "--no-cuda_graphs"], "float32"),
        (["--compile", "--activation_checkpoints"], "bf16"),
        (["--compile", "--grad_accum_steps", 2], "bf16"),
        (["--compile"], "bf16"),
        (["--compile", "--no-cuda_graphs"], "bf16"),
    ],
    ids=[
        "fp32",
        "bf16",
        "compiled",
        "compiled-no-graphs",
        "compiled-checkpointed-bf16",
        "compiled-accumulating-bf16",
        "compiled-bf16",
        "compiled-no-graphs-bf16",
    ],
)
def test_one_gpu_trains_without_fsdp_like_the_reference(tmp_path, corpus, extra, precision):
    """One rank trains a plain module (whole-model compile; bf16: autocast, or compiled the bf16
    copies of bf16_weights.py), not FSDP: same numbers. Compiled, the tiny model replays as CUDA
    graphs unless told not to (--cuda_graphs unset: by size)."""
    args = train_args(corpus, "one", [*extra, "--precision", precision])
    out = launch(args, ranks=1, cwd=tmp_path)
    compiled = "--compile" in extra
    graphs = compiled and "--no-cuda_graphs" not in extra
    copies = compiled and precision == "bf16"
    # the layout ends the banner's first line, or the threads' words follow it after "; "
    layout = re.search(r"; (no FSDP: one rank holds the whole model[^;\n]*)", out.stdout)
    assert layout and layout[1] == "no FSDP: one rank holds the whole model" + (
        ", computing with bf16 copies of its fp32 weights" if copies else ""
    ) + (", replayed as CUDA graphs" if graphs else ""), out.stdout
    ref_losses, _ = reference(args, world=1, device="cuda")
    assert logged_losses(corpus.parent, "one") == pytest.approx(ref_losses, **TOLERANCE[precision])


@pytest.mark.parametrize("extra", [[], ["--compile"]], ids=["eager", "compiled"])
def test_a_one_gpu_checkpoint_resumes_on_two_gpus_and_back(tmp_path, corpus, extra):
    """The plain module's checkpoints are FSDP's format: 1 GPU -> 2 GPUs (FSDP) -> 1 GPU, every
    launch resuming. Compiled, one GPU steps ClippedAdamW and two the one unit's LocalAdamW: the
    optimizer state moves between them."""
    base = train_args(
        corpus,
        "moves",
        ["--precision", "bf16", "--lr_decay_steps", 6, "--checkpoint_interval", 2, *extra],
    )
    for ranks, steps in ((1, 2), (2, 4), (1, 6)):
        out = launch([*base, "--max_steps", steps], ranks=ranks, cwd=tmp_path)
        assert (
            steps == 2
            or f"resuming from {tmp_path / 'checkpoints' / 'moves' / f'step_{steps - 2}'}"
            in out.stdout
        )
    losses = logged_losses(corpus.parent, "moves")
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.fixture(scope="module")
def reduced_over_nccl(tmp_path_factory):
    return run_reduce_ranks(tmp_path_factory.mktemp("reduce_nccl"), 2)


@pytest.mark.parametrize("case", REDUCE_CASES)
def test_nccl_sums_gradients_in_bf16_when_asked(reduced_over_nccl, case):
    """--reduce_precision bf16 over NCCL on 2 GPUs, as test_parallelize.py checks it over gloo: the
    same gradients on both ranks, bf16 values, within bf16's rounding of the float32 sums."""
    check_reduce_precision([result[case] for result in reduced_over_nccl], case)
