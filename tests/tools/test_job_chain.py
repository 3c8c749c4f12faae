"""Job chains (CHAIN=1) of the SLURM script, under a stand-in scheduler: sbatch queues the
successor, the test runs the queue in order (PBS's chains: test_pbs_chain.py). Three jobs of one
step each (--time_limit 00:00:00 stops a job after its first step, deterministically) train one
3-step run whose logged losses equal, bit for bit, those of the same run trained in one go; so does
a chain past a checkpoint damaged where progress.py cannot see it."""

import json
import os
import socket
import subprocess
import sys

import pytest

from minimal_fsdp.checkpoint import find

from conftest import ENTRY, ROOT
from fake_launchers import install_fakes, run_session
from support import chain_flags, flip_a_byte, logged_rows, trained_in_one_launch

STEPS = 3
# Settings a job gets only from the scheduler (qsub -v, or sbatch's exported environment), never
# from the test.
SETTINGS = (
    "ARGS",
    "VENV",
    "NRANKS_PER_NODE",
    "NDEPTH",
    "CPU_BIND",
    "MPIEXEC",
    "PYTHON",
    "ENTRY",
    "REPO",
    "CHAIN",
    "CHAIN_MARGIN",
    "JOB_SCRIPT",
)


def run_args(corpus):
    return chain_flags(corpus, STEPS)


def logged(work):
    """Every loss and val loss row of the run, across all its jobs: (step, loss) and (step,
    val_loss). The rows of save and restore seconds differ between a chain and one job (each job
    restores, and saves when it stops)."""
    return [
        (r["step"], r.get("loss"), r.get("val_loss"))
        for r in logged_rows(work, "chain")
        if "loss" in r or "val_loss" in r
    ]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: the same run on 2 ranks, in one launch."""
    return logged(trained_in_one_launch(tmp_path_factory, run_args))


def base_env(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SETTINGS and not k.startswith(("PBS_", "SLURM_"))
    }
    return dict(
        env,
        **install_fakes(tmp_path / "bin", tmp_path / "queue"),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )


def run_chain(tmp_path, first_job, next_job, max_jobs=6):
    """Runs the first job, then each job the last one queued, until none is queued; returns the
    outputs. A job is (command, environment, directory)."""
    outputs, job = [], first_job
    while job is not None:
        assert len(outputs) < max_jobs, "the chain does not end"
        result = run_session(*job)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        outputs.append(result.stdout)
        queued = sorted((tmp_path / "queue").glob("*.json"))
        job = next_job(json.loads(queued[-1].read_text())) if len(queued) == len(outputs) else None
    return outputs


@pytest.mark.slow
def test_slurm_chain_finishes_the_run_of_an_uninterrupted_job(tmp_path, corpus, straight):
    env = base_env(tmp_path)
    slurm = dict(
        SLURM_NTASKS="2",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST=socket.gethostname(),
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_JOB_ACCOUNT="ACCOUNT",
    )
    settings = dict(ENTRY=str(ENTRY), CHAIN="1", JOB_SCRIPT=str(ROOT / "slurm" / "train.sbatch"))
    flags = [*run_args(corpus), "--time_limit", "00:00:00"]
    jobs = ["1"]

    def next_job(queued):
        argv = queued["argv"]
        assert argv[:5] == [
            f"--dependency=afterany:{jobs[-1]}",
            "--nodes=1",
            "--time=1:00:00",
            "--account=ACCOUNT",
            settings["JOB_SCRIPT"],
        ]
        assert argv[5:] == flags
        jobs.append(queued["id"])
        # sbatch passes the submitting environment on (--export=ALL): the settings come along.
        return (
            ["bash", *argv[4:]],
            dict(env, **slurm, **settings, SLURM_JOB_ID=queued["id"]),
            tmp_path,
        )

    outputs = run_chain(
        tmp_path,
        (
            ["bash", settings["JOB_SCRIPT"], *flags],
            dict(env, **slurm, **settings, SLURM_JOB_ID="1"),
            tmp_path,
        ),
        next_job,
    )
    assert len(outputs) == STEPS and jobs == ["1", "2", "3"]
    assert "chain: the run reached its last step (3)" in outputs[-1]
    assert logged(tmp_path) == straight
    srun = [json.loads(line) for line in (tmp_path / "bin" / "srun.log").read_text().splitlines()]
    # squeue says 58:30 left; less CHAIN_MARGIN (300 s) is 53:30, and the flags' own --time_limit
    # comes after.
    assert all(" --time_limit 00:53:30 " in " ".join(argv) + " " for argv in srun)
    # The message names the --time_limit that applies: the flags' own.
    assert "--time_limit 00:00:00 (yours; the time left would allow 00:53:30)" in outputs[0]
    assert all(" ".join(argv).endswith("--time_limit 00:00:00") for argv in srun)


@pytest.mark.slow
def test_a_chain_stops_at_a_checkpoint_damaged_where_progress_cannot_see_and_a_resubmit_finishes(
    tmp_path, corpus, straight
):
    """progress.py does not read the shards' bytes (docs/checkpoints.md). A job that starts where it
    names a checkpoint with a damaged shard resumes from the one before, saves that step again and
    stops: the chain stops as if the job made no progress. Nothing is lost: the job submitted again
    finishes the run, losses unchanged."""
    env = dict(
        base_env(tmp_path),
        SLURM_NTASKS="2",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST=socket.gethostname(),
        SLURM_SUBMIT_DIR=str(tmp_path),
        ENTRY=str(ENTRY),
        CHAIN="1",
        JOB_SCRIPT=str(ROOT / "slurm" / "train.sbatch"),
    )

    def job(job_id):
        result = run_session(
            ["bash", env["JOB_SCRIPT"], *run_args(corpus), "--time_limit", "00:00:00"],
            dict(env, SLURM_JOB_ID=job_id),
            tmp_path,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    assert "chain: at step 1 of 3; submitting the next job" in job("1").stdout
    assert "chain: at step 2 of 3; submitting the next job" in job("2").stdout
    step_2 = tmp_path / "checkpoints" / "chain" / "step_2"
    flip_a_byte(step_2 / "__0_0.distcp")
    third = job("3")
    assert (
        "the run is at step 2" in third.stdout
        and "resuming from checkpoints/chain/step_1" in third.stdout
    )
    assert "__0_0.distcp does not match its checksum" in third.stderr
    assert "chain: stops: this job made no progress (still at step 2)" in third.stderr
    assert find.verify(step_2) is None  # saved again, whole
    assert "chain: the run reached its last step (3)" in job("4").stdout
    assert list(dict.fromkeys(logged(tmp_path))) == straight  # step 2 trained twice, alike


ARGV_DUMP = """#!{python}
import json, sys
# srun stand-in: the training command line (after srun's own options)
argv = sys.argv[1:]
while argv[0].startswith("-"):
    argv.pop(0)
print("ARGV " + json.dumps(argv[2:]))
"""
# scontrol show job JOBID, as SLURM 22.05 prints the output file: its patterns filled in
SCONTROL = """#!/bin/bash
echo "JobId=$3 JobName=minimal_fsdp"
echo "   StdErr=/submit/minimal_fsdp-$3.out"
echo "   StdOut=/submit/minimal_fsdp-$3.out"
"""


def sbatch_script(tmp_path, home, *flags, **env):
    """slurm/train.sbatch with srun stood in by one that prints the training flags; returns the
    result and those flags."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", ARGV_DUMP.format(python=sys.executable)), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environ = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "PYTHON": sys.executable,
        **env,
    }
    result = subprocess.run(
        ["bash", str(ROOT / "slurm" / "train.sbatch"), *flags],
        env=environ,
        capture_output=True,
        text=True,
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("ARGV ")), None)
    return result, json.loads(line[5:]) if line else None


def test_slurm_work_dir_takes_checkpoints_data_and_logs_and_the_job_log_is_named(tmp_path):
    """As in the PBS scripts (tests/tools/test_pbs_queues.py): WORK_DIR's folders come before the
    job's own flags, which win; the job's output file is named from scontrol; a WORK_DIR under
    $HOME is warned of."""
    work = tmp_path / "lustre" / "proj"
    result, argv = sbatch_script(tmp_path, "/nonexistent", "--max_steps", "2", WORK_DIR=str(work))
    assert result.returncode == 0, result.stderr
    assert argv == [
        "--environment", "auto",
        "--checkpoint_dir", f"{work}/checkpoints",
        "--data_dir", f"{work}/data",
        "--log_dir", f"{work}/logs",
        "--max_steps", "2",
    ]  # fmt: skip
    assert work.is_dir() and result.stderr == ""
    assert (
        f"work: checkpoints, data and logs under {work}; this job's output goes to "
        "/submit/minimal_fsdp-42.out (sbatch --output chooses)" in result.stdout
    )
    # the default, the submit folder (here under $HOME): no folder flags, a warning
    result, argv = sbatch_script(tmp_path, tmp_path, "--max_steps", "2")
    assert argv == ["--environment", "auto", "--max_steps", "2"]
    assert "warning: WORK_DIR=" in result.stderr and "is under $HOME" in result.stderr
