"""The PBS job scripts under a stand-in PBS that behaves as ALCF documents Polaris' (fake_pbs.py):
a chain through the routing queue prod ended by the walltime's SIGTERM, a preemptable job killed
without warning and run again (-r y), and a preemption with SIGTERM of a rerunnable job. Each ends
the training run, the losses equal bit for bit those of the run trained in one go, and no more than
one checkpoint interval is trained twice.

The jobs run tests/faults.py, which holds every rank in step PAUSE until a file exists: the stand-in
interrupts the job there, so where it lands never depends on timing."""

import json
import os
import re
import subprocess
import sys

import pytest

import fake_pbs
from conftest import ROOT, make_text, mpiexec
from support import chain_flags, trained_in_one_launch

STEPS = 6
INTERVAL = 2  # --checkpoint_interval
PAUSE = 4  # the step the ranks are held in (steps 1-3 done, step_2 saved)
SHARDING = ["--sharding", "hybrid-full-shard"]  # pbs/train_multi_node.sh's
# a file name that qsub -v ARGS=... would split, and a shell would split too
CORPUS = "corpus, v1.txt"


def train_flags(corpus):
    return chain_flags(corpus, STEPS, "--checkpoint_interval", str(INTERVAL))


def rows(metrics):
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def losses(metrics):
    """(step, loss) of every logged step, in the order logged (a step trained twice appears
    twice)."""
    return [(r["step"], r["loss"]) for r in rows(metrics) if "loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: the same run on 2 ranks, in one launch."""
    work = trained_in_one_launch(tmp_path_factory, lambda c: [*train_flags(c), *SHARDING], CORPUS)
    return losses(work / "logs" / "chain" / "metrics.jsonl")


class Cluster:
    """The stand-in PBS, a submit folder (`submit`, where qsub runs) and a project folder
    (`work`, WORK_DIR)."""

    def __init__(self, tmp_path):
        self.submit_dir = tmp_path / "submit"
        self.work = tmp_path / "eagle" / "project"
        self.submit_dir.mkdir()
        (self.submit_dir / CORPUS).write_text(make_text())
        self.release = tmp_path / "release"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PBS_", "SLURM_", "MINIMAL_FSDP_")) and k not in ("ARGS", "CHAIN")
        }
        self.env = dict(
            env,
            **fake_pbs.install(tmp_path / "bin", tmp_path / "pbs"),
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
        )
        self.server = fake_pbs.Server(tmp_path / "pbs", self.env, tmp_path / "home")
        # Logs each python command line (the training's and progress's) of the jobs.
        self.python = tmp_path / "python"
        self.python.write_text(
            f'#!/bin/bash\necho "$*" >> {tmp_path}/python.log\nexec {sys.executable} "$@"\n'
        )
        self.python.chmod(0o755)
        self.python_log = tmp_path / "python.log"

    def settings(self, faults=f"pause@{PAUSE}"):
        """The -v settings of the first job: CPU_BIND empty (Hydra's mpiexec knows --ppn but not
        Cray's --depth); settings of the user's own, which the successors must get too."""
        return dict(
            REPO=str(ROOT),
            WORK_DIR=str(self.work),
            MPIEXEC=mpiexec(),
            NRANKS_PER_NODE="2",
            NDEPTH="1",
            CPU_BIND="",
            PYTHON=str(self.python),
            ENTRY=str(ROOT / "tests" / "faults.py"),
            CHAIN="1",
            MINIMAL_FSDP_FAULTS=faults,
            MINIMAL_FSDP_RELEASE=str(self.release),
            AWS_OFI_NCCL=str(self.submit_dir / "no-ofi-plugin"),
            NCCL_DEBUG="INFO",
            NCCL_SOCKET_NTHREADS="3",
        )

    def qsub(self, *options, settings, args):
        """qsub as a user types it: -v NAME=value, and by name only (the value from qsub's
        environment, as it is) ARGS and any value with a comma, which -v NAME=value would split."""
        listed = [k if "," in v else f"{k}={v}" for k, v in settings.items()]
        result = subprocess.run(
            [
                "qsub",
                *options,
                "-v",
                ",".join([*listed, "ARGS"]),
                str(ROOT / "pbs" / "train_multi_node.sh"),
            ],
            env=dict(self.env, **settings, ARGS=args),
            cwd=self.submit_dir,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    def paused(self):
        """The ranks are held in step PAUSE: step PAUSE - 1 is logged."""
        metrics = self.work / "logs" / "chain" / "metrics.jsonl"
        return metrics.exists() and any(r.get("step") == PAUSE - 1 for r in rows(metrics))

    def interrupt(self, how):
        """At the pause, `how`; then the ranks may go on (the run again, after a kill)."""
        return (self.paused, how, self.release.touch)

    def metrics(self):
        return self.work / "logs" / "chain" / "metrics.jsonl"

    def job(self, job_id):
        return self.server.state.get(job_id)


def args_text():
    """ARGS as a user writes it: the file name quoted, a comma inside."""
    return f"--dataset text --input_file '{CORPUS}' " + " ".join(train_flags("X")[4:])


def check_trained_once_more_at_most(cluster, straight, resumed_from):
    logged = losses(cluster.metrics())
    assert list(dict.fromkeys(logged)) == straight  # every step's loss as in one go
    repeated = len(logged) - len(straight)
    assert repeated <= INTERVAL and len(logged) - len(set(s for s, _ in logged)) == repeated
    progress = subprocess.run(
        [
            sys.executable,
            "-m",
            "minimal_fsdp",
            "progress",
            "--checkpoint_dir",
            str(cluster.work / "checkpoints"),
            "--run_name",
            "chain",
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert progress.stdout.split() == [str(STEPS), str(STEPS)]
    assert resumed_from in {f"step_{s}" for s in range(PAUSE - INTERVAL, PAUSE + 1)}


@pytest.mark.slow
def test_a_chain_through_prod_survives_the_walltime_sigterm_and_keeps_every_setting(
    tmp_path, straight
):
    """qsub -q prod with 10 nodes for 3 h: routed to small. At the walltime PBS sends SIGTERM (a
    kill 300 s later): the run saves and exits 0, and the job script, which trapped the signal,
    submits the successor to prod (not small), with the same account, resources and every -v
    setting, the user's NCCL ones and ARGS with its comma and quotes included."""
    cluster = Cluster(tmp_path)
    settings = cluster.settings()
    first = cluster.qsub(
        "-A",
        "PROJECT",
        "-q",
        "prod",
        "-l",
        "select=10:system=polaris",
        "-l",
        "walltime=03:00:00",
        settings=settings,
        args=args_text(),
    )
    assert cluster.job(first)["exec_queue"] == "small"
    runs = cluster.server.drain(interrupts=[cluster.interrupt("walltime")])
    assert [r.job_id for r in runs] == [first, "2.fake-pbs"]
    assert [r.requeued for r in runs] == [False, False]
    assert runs[0].returncode == 0, runs[0].output[-3000:]  # it ended before the kill
    assert "job: SIGTERM from PBS" in runs[0].output
    assert re.search(
        rf"chain: at step {PAUSE} of {STEPS}; submitting the next job to prod", runs[0].output
    )
    assert runs[1].returncode == 0 and "chain: the run reached its last step (6)" in runs[1].output
    second = cluster.job("2.fake-pbs")
    assert second["queue"] == "prod" and second["exec_queue"] == "small"
    assert second["depend"] == [first] and second["account"] == "PROJECT"
    assert second["resources"] == cluster.job(first)["resources"]
    assert second["rerunnable"] is True
    passed = {k: v for k, v in second["variables"].items() if not k.startswith("PBS_O_")}
    assert passed == {**settings, "ARGS": args_text()}
    # checkpoints and logs in WORK_DIR, none in the submit folder; the job's output where PBS
    # puts it
    assert (cluster.work / "checkpoints" / "chain" / f"step_{STEPS}").is_dir()
    assert not (cluster.submit_dir / "checkpoints").exists()
    assert "minimal_fsdp.o1 when the job ends" in runs[0].output
    assert (cluster.submit_dir / "minimal_fsdp.o2").read_text() == runs[1].output
    # --time_limit from the walltime: 03:00:00 less CHAIN_MARGIN (300 s) and the seconds run so far
    assert re.search(r"--time_limit 02:5[45]:\d\d ", cluster.python_log.read_text())
    resumed = re.search(r"resuming from \S*/(step_\d+)", runs[1].output)[1]
    assert resumed == f"step_{PAUSE}"  # saved at the stop: nothing trained twice
    check_trained_once_more_at_most(cluster, straight, resumed)


@pytest.mark.slow
def test_a_preemptable_job_killed_without_warning_runs_again_and_resumes(tmp_path, straight):
    """-q preemptable: the demand queue takes the nodes with SIGKILL, no warning. The scripts are
    rerunnable (#PBS -r y): PBS runs the job again under its id, and it resumes from the last
    checkpoint, training at most one checkpoint interval again."""
    cluster = Cluster(tmp_path)
    first = cluster.qsub(
        "-A",
        "PROJECT",
        "-q",
        "preemptable",
        "-l",
        "walltime=06:00:00",
        settings=cluster.settings(),
        args=args_text(),
    )
    runs = cluster.server.drain(interrupts=[cluster.interrupt("preempt-kill")])
    assert [r.job_id for r in runs] == [first, first]
    assert runs[0].requeued and runs[0].returncode == 256 + 9
    assert runs[1].returncode == 0, runs[1].output[-3000:]
    assert "chain: the run reached its last step (6)" in runs[1].output
    resumed = re.search(r"resuming from \S*/(step_\d+)", runs[1].output)[1]
    assert resumed == f"step_{PAUSE - INTERVAL}"  # the last save before the kill
    check_trained_once_more_at_most(cluster, straight, resumed)


@pytest.mark.slow
def test_a_rerunnable_job_preempted_with_sigterm_submits_one_successor(tmp_path, straight):
    """A preemption with SIGTERM: the run saves, the script submits the successor, and PBS then
    requeues the job (-r y) and runs it again. That run stops short of the end too (its clock says
    the time is up from step PAUSE + 1 on) and must not submit a second successor: two jobs would
    then train the run at once."""
    cluster = Cluster(tmp_path)
    settings = cluster.settings(faults=f"pause@{PAUSE},clock@{PAUSE + 1}")
    first = cluster.qsub(
        "-A",
        "PROJECT",
        "-q",
        "preemptable",
        "-l",
        "walltime=06:00:00",
        settings=settings,
        args=args_text(),
    )
    runs = cluster.server.drain(interrupts=[cluster.interrupt("preempt-term")])
    assert [r.job_id for r in runs] == [first, first, "2.fake-pbs"]
    assert runs[0].requeued and runs[0].returncode == 0
    assert "chain: submitted 2.fake-pbs" in runs[0].output
    assert f"job {first} submitted its successor before: 2.fake-pbs" in runs[1].output
    assert len(cluster.server.state.jobs()) == 2
    assert "chain: the run reached its last step (6)" in runs[2].output
    resumed = re.search(r"resuming from \S*/(step_\d+)", runs[1].output)[1]
    check_trained_once_more_at_most(cluster, straight, resumed)
