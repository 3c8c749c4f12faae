"""Runs that end early and come back. A run stopped (by --max_steps, SIGTERM, --time_limit, a crash
mid-save) and resumed computes bitwise the same losses as one that never stopped, dropout included;
a checkpoint loads on another number of ranks with another sharding with every tensor equal; a dead,
hung or diverged rank ends the job instead of hanging it."""

import json
import math
import signal

import pytest
import torch.distributed as dist

from minimal_fsdp.checkpoint import find, meta, safe_load
from minimal_fsdp.config.checks import parse_duration
from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.launch.resilience import StopRequests

from conftest import TINY_MODEL, launch_runs, make_text, printed_by_run
from faults import launch_with_faults

STEPS = 20


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    (work / "corpus.txt").write_text(make_text())
    return work


def args(run_name, *extra):
    """Flags of a 20-step run; `extra` comes last, so it overrides (argparse keeps a flag's last
    value). --lr_decay_steps fixes the LR schedule's horizon: a launch stopped early by --max_steps
    5 is on the same schedule as the uninterrupted 20-step run."""
    return [
        "--dataset",
        "text",
        "--input_file",
        "corpus.txt",
        *TINY_MODEL,
        "--dropout",
        0.1,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--warmup_steps",
        2,
        "--lr_decay_steps",
        STEPS,
        "--max_steps",
        STEPS,
        "--run_name",
        run_name,
        *extra,
    ]


def losses(work, run_name):
    """Every logged (step, loss), in order, across all launches of the run."""
    rows = [
        json.loads(line)
        for line in (work / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def clean_runs(work):
    """The runs without faults, one after the other in one launch (conftest.launch_runs): the
    uninterrupted reference, and the first launch of test_stopped_runs_resume_bitwise's chain.
    Returns what each printed."""
    out = launch_runs(
        [args("straight", "--checkpoint_interval", 10), args("chain", "--max_steps", 5)], cwd=work
    )
    printed = dict(printed_by_run(out.stdout))
    assert list(printed) == ["straight", "chain"], out.stdout[-3000:]
    return printed


@pytest.fixture(scope="module")
def straight(work, clean_runs):
    """The uninterrupted reference: 2 ranks, 20 steps, dropout on, a checkpoint at step 10."""
    return dict(losses(work, "straight"))


@pytest.mark.slow
def test_stopped_runs_resume_bitwise(work, clean_runs, straight):
    run = work / "checkpoints" / "chain"
    # The first launch of the chain, stopped by --max_steps 5, ran in clean_runs' launch.
    assert "starting fresh" in clean_runs["chain"] and find.latest(run) == run / "step_5"

    # A signal reaches one rank only; both stop at the step boundary, save, and exit 0.
    term = launch_with_faults(args("chain"), faults="sigterm@10:1", cwd=work)
    assert "step 10: SIGTERM received; saved a checkpoint" in term.stdout
    assert find.latest(run) == run / "step_10" and not (run / "step_20").exists()

    timed = launch_with_faults(
        args("chain", "--time_limit", "1:00:00"), faults="clock@15:0", cwd=work
    )
    assert (
        "step 15: --time_limit of 3600s reached" in timed.stdout
        and find.latest(run) == run / "step_15"
    )

    # Killed while writing its shard of step 20: step_15 stays the newest complete checkpoint.
    crashed = launch_with_faults(args("chain"), faults="kill_in_save@20:1", cwd=work, check=False)
    assert crashed.returncode != 0
    assert not (run / "step_20").exists() and (run / ".tmp-step_20").exists()
    assert find.latest(run) == run / "step_15"

    final = launch_with_faults(args("chain"), cwd=work)
    assert "resuming from checkpoints/chain/step_15" in final.stdout
    assert find.latest(run) == run / "step_20" and not list(run.glob(".tmp-*"))

    chain = losses(work, "chain")
    assert sorted({step for step, _ in chain}) == list(range(1, STEPS + 1))
    for step, loss in chain:  # every launch's losses, those of the crashed one included
        assert loss == straight[step], (step, loss, straight[step])
    assert straight[STEPS] < straight[1]


# (ranks, sharding) in order: each loads the checkpoint the one before wrote. The first loads the
# straight run's (2 ranks, full-shard, the tiny model as whole_unit.py's one unit), so the chain
# covers 2->4, full->hybrid, one unit -> FSDP2's unit per block, 4->3, FSDP2 -> the one unit sharded
# unevenly over 3 ranks and resumed in bf16, 3->1, the unit -> a plain model, 1->2, a plain model ->
# no-shard's one unit, that unit -> DDP.
ELASTIC = [
    (4, ["--sharding", "hybrid-full-shard", "--shard_group_size", 2, "--fsdp_unit", "block"]),
    (3, ["--sharding", "full-shard", "--precision", "bf16"]),
    (1, ["--sharding", "full-shard"]),
    (2, ["--sharding", "no-shard"]),
    (2, ["--sharding", "no-shard", "--fsdp_unit", "block"]),
]


@pytest.mark.slow
def test_checkpoints_load_on_other_world_sizes_and_shardings(work, straight):
    source = work / "checkpoints" / "straight" / "step_10"
    for i, (ranks, sharding) in enumerate(ELASTIC):
        step = 10 + 2 * (i + 1)
        restart = ["--restart_checkpoint_file", source] if i == 0 else []
        report = work / f"load_{i}.json"
        launch_with_faults(
            args("elastic", *sharding, *restart, "--max_steps", step),
            ranks=ranks,
            cwd=work,
            check_load=report,
        )
        verdict = json.loads(report.read_text())
        assert verdict["checked"] > 50, verdict  # model and AdamW tensors
        assert verdict["only_live"] == verdict["only_saved"] == verdict["different"] == [], (
            ranks,
            sharding,
            verdict,
        )
        trained = losses(work, "elastic")
        assert [s for s, _ in trained[-2:]] == [step - 1, step] and all(
            math.isfinite(loss) for _, loss in trained
        )
        source = work / "checkpoints" / "elastic" / f"step_{step}"
        assert meta.read_meta(source)["world_size"] == ranks


def saved_steps(run):
    """The run's checkpoints, each checked complete (verify) with finite weights; and the step
    `latest` names."""
    steps = []
    for path in find.step_dirs(run):
        assert find.verify(path) is None, path
        assert all(t.isfinite().all() for t in safe_load.load_full_model_state(path).values()), path
        steps.append(int(path.name.removeprefix("step_")))
    return sorted(steps), (run / "latest").read_text().strip()


def one_error_line(result, starts):
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(starts), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_nan_with_default_flags_stops_before_the_next_checkpoint(work):
    """The default check is deferred (no per-step sync): with logging every 100 steps the NaN of
    step 3 is first looked at before step 4's checkpoint, which must not be written."""
    result = launch_with_faults(
        args("nan_default", "--checkpoint_interval", 2, "--max_steps", 8, "--log_interval", 100),
        faults="nan@3:1",
        cwd=work,
        check=False,
    )
    one_error_line(result, "error: step 3: the grad norm is nan")
    assert saved_steps(work / "checkpoints" / "nan_default") == ([2], "step_2")


@pytest.mark.slow
def test_skip_nonfinite_skips_the_step_and_goes_on(work):
    result = launch_with_faults(
        args("nan_skip", "--checkpoint_interval", 2, "--max_steps", 6, "--skip_nonfinite", 1),
        faults="nan@3:1",
        cwd=work,
    )
    assert (
        "warning: step 3: grad norm nan; update skipped (1 of --skip_nonfinite 1)" in result.stderr
    )
    run = work / "checkpoints" / "nan_skip"
    assert saved_steps(run) == ([2, 4, 6], "step_6")
    names = [
        name
        for name, _, _ in safe_load.tensor_names(run / "step_6", "optim.state.")
        if name.endswith(".step")
    ]
    counts = safe_load.read_tensors(run / "step_6", names, "optim.state.")
    # 6 steps, one update skipped
    assert names and all(count.item() == 5 for count in counts.values())
    # the skipped step's loss is not logged
    assert [step for step, _ in losses(work, "nan_skip")] == [1, 2, 4, 5, 6]


@pytest.mark.slow
def test_diverged_run_names_the_step_and_keeps_the_last_checkpoint(work):
    result = launch_with_faults(
        args("nan", "--checkpoint_interval", 2, "--skip_nonfinite", 1, "--max_steps", 8),
        faults="nan@3:1,nan@5:1",
        cwd=work,
        check=False,
    )
    assert (
        "warning: step 3: grad norm nan; update skipped (1 of --skip_nonfinite 1)" in result.stderr
    )
    one_error_line(result, "error: step 5: the grad norm is nan")
    # step 4 came after the skipped step 3, with finite weights
    assert saved_steps(work / "checkpoints" / "nan") == ([2, 4], "step_4")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill@3:1", "hang@3:1"])
def test_a_dead_or_hung_rank_ends_the_job(work, fault):
    # The launch timeout (not an assertion on time) is what would catch a job left hanging.
    name = "fail_" + fault[:4]
    result = launch_with_faults(
        args(name, "--collective_timeout", 5, "--max_steps", 6, "--checkpoint_interval", 2),
        faults=fault,
        cwd=work,
        check=False,
        timeout=240,
    )
    # mpiexec reports the rank's death by SIGKILL and ends the job with it
    if fault.startswith("kill"):
        assert result.returncode == signal.SIGKILL and "Killed (signal 9)" in result.stdout, (
            result.stdout[-2000:]
        )
    else:  # the waiting rank's collective times out: one clear line, non-zero exit
        assert result.returncode != 0 and "waited longer than --collective_timeout" in result.stderr
    # the step-2 checkpoint, whole
    assert saved_steps(work / "checkpoints" / name) == ([2], "step_2")
    assert not list((work / "checkpoints" / name).glob(".tmp-*"))


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_stop_requests_agree_on_signals_and_time_limit(one_rank):
    stop = StopRequests(time_limit_seconds=3600)
    with stop.listening():
        assert stop.agreed() is None
        signal.raise_signal(signal.SIGUSR1)
        assert stop.agreed() == "SIGUSR1 received"
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # only caught while training
    assert StopRequests(time_limit_seconds=0).agreed() == "--time_limit of 0s reached"


def test_time_limit_format():
    assert (
        parse_duration("01:30:00") == 5400
        and parse_duration("45:00") == 2700
        and parse_duration("90") == 90
    )
    for bad in ("1h", "1:2:3:4", "-1:00"):
        with pytest.raises(ConfigError, match="--time_limit must look like HH:MM:SS"):
            parse_duration(bad)
