"""Decentralized training end to end: it learns as well as all-reduce on the same tokens,
checkpoints keep each rank's replica and resume exactly, bad flag combinations stop before training;
on GPUs (marked gpu): gossip over NCCL, and the bytes/step-time benchmark against all-reduce."""

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import reference as plain
from conftest import ROOT, TINY_MODEL, launch, launch_runs, make_text, mpiexec, printed_by_run
from support import (
    DECENTRALIZED,
    check_mixing,
    check_quadratic,
    decentralized_reference,
    run_dirs,
    run_gossip_ranks,
)

sys.path.insert(0, str(ROOT))
from minimal_fsdp.checkpoint import (
    find,
    meta,
    safe_load,  # noqa: E402
)
from minimal_fsdp.config.flags import ConfigError, parse_args  # noqa: E402
from minimal_fsdp.config.sections import Optimizer  # noqa: E402
from minimal_fsdp.models.gpt import GPT, GPTConfig  # noqa: E402
from minimal_fsdp.parallel.accum_adamw import AccumAdamW  # noqa: E402
from minimal_fsdp.parallel.gossip import TOPOLOGIES  # noqa: E402
from minimal_fsdp.train import build_optimizer  # noqa: E402

from support import command


def common_args(corpus, extra=()):
    work = corpus.parent
    return [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *run_dirs(work),
        *TINY_MODEL,
        "--dropout",
        "0.0",
        *extra,
    ]


def metrics(work, run_name):
    return [
        json.loads(line)
        for line in (work / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]


def allreduce_val_loss(args, world):
    """All-reduce training done plainly in one process (reference.py; test_parallelize shows the
    FSDP runs equal it), then the val loss over every rank's val batches, as evaluate() averages
    it."""
    cfg, data, model, losses = plain.train(args, world)
    return plain.val_loss(model, data, cfg, world), len(losses)


def checkpoint_tensors(path, prefix):
    """Every tensor whose key starts with `prefix` in a checkpoint, read in this process."""
    reader = safe_load.SafeReader(str(path))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        if state:
            dcp.load(
                state, storage_reader=reader, planner=safe_load.SafeLoadPlanner(), no_dist=True
            )
    return state


@pytest.mark.slow
def test_val_loss_within_3_percent_of_allreduce(tmp_path):
    """4 ranks, same tokens: alternating-exp-ring gossip with AccumAdamW against all-reduce with
    AdamW."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(250_000))
    args = common_args(
        corpus,
        [
            "--eval_batches",
            8,
            "--max_epochs",
            2,
            "--max_steps",
            600,
            "--lr",
            "6e-3",
            "--warmup_steps",
            20,
            "--log_interval",
            100,
            "--eval_interval",
            0,
        ],
    )
    launch(
        [*args, *DECENTRALIZED, "--accum_steps", 4, "--save_average", "--run_name", "dec"],
        ranks=4,
        cwd=tmp_path,
    )
    rows = metrics(tmp_path, "dec")
    decentralized = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    allreduce, steps = allreduce_val_loss(args, world=4)
    assert steps == 600 and allreduce < 1.0  # both learned far from the untrained ~ln(vocab) = 3.4
    assert abs(decentralized - allreduce) <= 0.03 * allreduce, (decentralized, allreduce)

    # its value is checked exactly below
    consensus = [r["consensus"] for r in rows if "consensus" in r]
    # the final evaluation
    assert len(consensus) == 1 and all(c > 0 and math.isfinite(c) for c in consensus)
    final = find.latest(tmp_path / "checkpoints" / "dec")
    assert meta.read_meta(final)["replicas"] == 0  # --save_average: the average only
    assert not checkpoint_tensors(final, "replicas.") and checkpoint_tensors(final, "model.")


@pytest.mark.slow
def test_checkpoint_keeps_each_replica_and_resumes_exactly(
    tmp_path, corpus, single_process, capsys
):
    """3 ranks (exp distances 1 and 2 on a non-power-of-two world); stop mid accumulation window,
    resume. The whole run and the resumed one run one after the other in one launch
    (conftest.launch_runs)."""
    plain = common_args(corpus, ["--max_steps", 6, "--eval_interval", 0, "--log_interval", 1])
    # the reference's fp32
    args = [*plain, *DECENTRALIZED, "--accum_steps", 2, "--gossip_dtype", "float32"]
    whole = tmp_path / "checkpoints" / "whole"
    out = launch_runs(
        [
            [*args, "--run_name", "whole", "--checkpoint_interval", 3],
            [*args, "--run_name", "resumed", "--restart_checkpoint_file", whole / "step_3"],
        ],
        ranks=3,
        cwd=tmp_path,
    )
    printed = printed_by_run(out.stdout)
    assert [name for name, _ in printed] == ["whole", "resumed"] and "starting fresh" in printed[0][
        1
    ]
    assert f"resuming from {whole / 'step_3'}" in printed[1][1]

    resumed = tmp_path / "checkpoints" / "resumed" / "step_6"
    assert meta.read_meta(resumed)["replicas"] == 3
    # model and optimizer state (moments, accumulated gradient, step) of every replica
    for rank in range(3):
        expected = checkpoint_tensors(whole / "step_6", f"replicas.{rank}.")
        got = checkpoint_tensors(resumed, f"replicas.{rank}.")
        assert expected.keys() == got.keys() and any("accum_grad" in key for key in got)
        for key in expected:
            assert torch.equal(expected[key], got[key]), key
    losses = [r["loss"] for r in metrics(tmp_path, "whole") if "loss" in r]
    assert [r["loss"] for r in metrics(tmp_path, "resumed") if "loss" in r] == losses[3:]

    # The whole run against the gossip done plainly on stacked replicas: losses, consensus,
    # final replicas.
    expected, final_replicas = decentralized_reference(args, world=3, steps=6)
    # The consensus distance is measured at evaluation steps only (here the saves, 3 and 6), never
    # at logging steps.
    consensus = {r["step"]: r["consensus"] for r in metrics(tmp_path, "whole") if "consensus" in r}
    assert losses == pytest.approx([loss for loss, _ in expected], abs=2e-6)
    assert list(consensus) == [3, 6]
    assert list(consensus.values()) == pytest.approx([expected[2][1], expected[5][1]], rel=1e-4)
    for rank, state in enumerate(final_replicas):
        saved = checkpoint_tensors(whole / "step_6", f"replicas.{rank}.model.")
        for name, value in state.items():
            torch.testing.assert_close(
                saved[f"replicas.{rank}.model.{name}"], value, atol=2e-6, rtol=1e-5, msg=name
            )

    # All-reduce (AdamW) from it is refused: one rank, in this process (as
    # `python basic_training.py`).

    capsys.readouterr()
    with pytest.raises(SystemExit) as mixed:
        command("train", *list(map(str, [*plain, "--run_name", "whole"])))
    assert (
        mixed.value.code == 2
        and "trained with --data_parallel decentralized" in capsys.readouterr().err
    )

    replicas = [
        checkpoint_tensors(whole / "step_6", f"replicas.{rank}.model.") for rank in range(3)
    ]
    average = safe_load.load_full_model_state(whole / "step_6")
    assert not torch.equal(
        replicas[0]["replicas.0.model.wte.weight"], replicas[1]["replicas.1.model.wte.weight"]
    )
    for name, value in average.items():
        mean = sum(r[f"replicas.{rank}.model.{name}"] for rank, r in enumerate(replicas)) / 3
        torch.testing.assert_close(value, mean, atol=1e-6, rtol=1e-5, msg=name)

    # Elastic: 3 replicas resumed on 2 ranks start both ranks from their average, and say so.
    out = launch(
        [
            *args,
            "--run_name",
            "elastic",
            "--max_steps",
            4,
            "--restart_checkpoint_file",
            whole / "step_3",
        ],
        ranks=2,
        cwd=tmp_path,
    )
    assert (
        f"{whole / 'step_3'} holds 3 replicas and this run has 2 ranks: every rank starts from "
        f"their average" in out.stdout
    )
    assert [r["step"] for r in metrics(tmp_path, "elastic") if "loss" in r] == [4]


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--data_parallel", "decentralized", "--sharding", "hybrid-full-shard"],
            "drop --sharding hybrid-full-shard",
        ),
        (["--data_parallel", "decentralized", "--cpu_offload"], "--cpu_offload"),
        (["--accum_steps", "4"], "--accum_steps applies to --data_parallel decentralized"),
        (["--save_average"], "--save_average applies to --data_parallel decentralized"),
        (
            ["--data_parallel", "decentralized", "--accum_steps", "0"],
            "--accum_steps must be positive",
        ),
        (["--data_parallel", "decentralized", "--topology", "star"], "invalid choice: 'star'"),
    ],
)
def test_bad_flag_combinations(args, message):
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        parse_args(args)


def test_mode_defaults():
    model = GPT(GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8))
    decentralized = build_optimizer(
        model, Optimizer.of(parse_args(["--data_parallel", "decentralized"]))
    )
    assert isinstance(decentralized, AccumAdamW) and decentralized.defaults["betas"] == (0.9, 0.98)
    allreduce = build_optimizer(model, Optimizer.of(parse_args([])))
    assert isinstance(allreduce, torch.optim.AdamW) and allreduce.defaults["betas"] == (0.9, 0.95)


# GPU (run on the GPU machine with `pytest -m gpu tests/parallel/test_decentralized.py`).
needs_four_gpus = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")


@pytest.fixture(scope="module")
def nccl_result(tmp_path_factory):
    result = run_gossip_ranks(4, tmp_path_factory.mktemp("nccl") / "result.json")
    assert result["device"] == "cuda"
    return result


@pytest.mark.gpu
@needs_four_gpus
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_nccl_gossip_applies_mixing_matrices(nccl_result, topology):
    check_mixing(nccl_result, topology)
    if topology in ("ring", "exp"):
        check_quadratic(nccl_result, topology)


@pytest.mark.gpu
@needs_four_gpus
def test_gpu_benchmark_bytes_and_step_time(tmp_path):
    """GPT-2 124M on 4 GPUs, all-reduce and every topology; the printed rows go to
    benchmarks/results/LOG.md."""
    out = tmp_path / "gossip.jsonl"
    cmd = [
        mpiexec(),
        "-n",
        "4",
        sys.executable,
        str(ROOT / "benchmarks" / "gossip_bench.py"),
        "--model_preset",
        "gpt2",
        "--vocab_size",
        "50304",
        "--batch_size",
        "16",
        "--precision",
        "bf16",
        "--out",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    print(result.stdout)
    rows = {r["topology"]: r for r in map(json.loads, out.read_text().splitlines())}
    params = rows["ring"]["params"]
    assert rows["ring"]["bytes_per_step"] == 2 * 4 * params  # two neighbours, fp32
    assert rows["exp"]["bytes_per_step"] == 4 * params  # one peer
    # ring all-reduce, fp32 grads
    assert rows["-"]["bytes_per_step"] == pytest.approx(2 * 3 / 4 * 4 * params)
    assert all(r["step_ms"] > 0 for r in rows.values())


def test_a_decentralized_checkpoint_holds_the_mean_of_the_replicas(monkeypatch):
    """The checkpoint's `model` and `optim` (what sample, export and all-reduce runs read) are the
    network average of every floating-point tensor, nested at any depth; counts and settings are
    left as they are. In this process: three ranks written out, the others holding this rank's
    values + 1 and + 2, so the mean is this rank's + 1."""
    from minimal_fsdp.checkpoint import checkpointer

    reduced = []

    def all_reduce(tensor, op=None, group=None):  # SUM over ranks holding t, t + 1, t + 2
        reduced.append(tensor)
        tensor.mul_(3).add_(3)

    monkeypatch.setattr(checkpointer.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(checkpointer.dist, "get_world_size", lambda group=None: 3)
    weight, moment = torch.randn(4, 2), torch.rand(4, 2)
    original = weight.clone()
    own = {
        "model": {"w": weight},
        "optim": {
            "state": {"w": {"step": torch.tensor(6.0), "exp_avg_sq": moment}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
            "count": torch.tensor([7], dtype=torch.int64),
        },
    }
    mean = checkpointer._network_average(own)
    assert torch.allclose(mean["model"]["w"], weight + 1)
    assert torch.allclose(mean["optim"]["state"]["w"]["exp_avg_sq"], moment + 1)
    assert mean["optim"]["state"]["w"]["step"].item() == 7.0
    assert mean["optim"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    assert mean["optim"]["count"].tolist() == [7] and len(reduced) == 3
    assert torch.equal(own["model"]["w"], original)  # the replica itself is not changed
