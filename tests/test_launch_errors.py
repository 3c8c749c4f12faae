"""Launch failures seen on real clusters, faked here: the launcher's variables set by hand, a stand-in srun, a
port held by the test. Each ends every process of the job with one `error:` line and a non-zero exit;
run_session fails the test if any process is left behind (the timeouts only catch a hang)."""
import datetime
import os
import socket
import sys

import pytest
import torch.distributed as dist

from conftest import ENTRY, ROOT, TINY_MODEL, mpiexec
from fake_launchers import error_lines, install_fakes, run_session

# Variables of the launcher that runs pytest (a test may itself run under one) that would mislead the job.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE",
                    "PMI_FD", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_NAMESPACE",
                    "PALS_RANKID", "PBS_NODEFILE")


def job_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    return dict(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def training(corpus, *extra):
    return [sys.executable, str(ENTRY), "--dataset", "text", "--input_file", str(corpus), *TINY_MODEL,
            "--max_steps", "2", "--eval_interval", "0", "--collective_timeout", "120", *extra]


def one_error(result, expected):
    assert result.returncode != 0, result.stdout[-2000:]
    errors = error_lines(result)
    assert len(errors) == 1, result.stderr[-3000:]
    assert expected in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def held_port():
    """A port some other program is listening on."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        yield s.getsockname()[1]


def test_mpi4py_of_another_mpi_is_not_a_silent_world_of_one(tmp_path, corpus):
    """Cray's mpiexec (PALS) starting ranks whose mpi4py comes from the mpich wheel: MPI_Init gives each
    process a world of its own. Both stop; the launcher's rank 0 says why."""
    train = " ".join(training(corpus))
    script = (f"PALS_RANKID=0 PMI_SIZE=2 {train} & first=$!; PALS_RANKID=1 PMI_SIZE=2 {train}; second=$?; "
              "wait $first; first=$?; echo exits $first $second; exit $((first | second))")
    result = run_session(["bash", "-c", script], job_env(), tmp_path)
    assert "exits 2 2" in result.stdout
    line = one_error(result, "the launcher started 2 ranks but mpi4py's MPI (MPICH")
    assert "sees a world of 1" in line and "docs/launch.md" in line
    assert not (tmp_path / "checkpoints").exists()


def test_master_port_in_use_ends_the_mpi_job(tmp_path, corpus, held_port):
    result = run_session([mpiexec(), "-n", "2", *training(corpus)], job_env(MASTER_PORT=str(held_port)), tmp_path)
    one_error(result, f"MASTER_PORT {held_port} is already in use")
    assert result.returncode == 2


def test_unresolvable_master_addr_ends_the_mpi_job(tmp_path, corpus):
    result = run_session([mpiexec(), "-n", "2", *training(corpus)], job_env(MASTER_ADDR="no-such-host.invalid"),
                         tmp_path)
    one_error(result, "rank 1: MASTER_ADDR no-such-host.invalid does not resolve")
    assert result.returncode == 2


def test_pbs_without_nodefile_ends_the_mpi_job(tmp_path, corpus):
    result = run_session([mpiexec(), "-n", "2", *training(corpus, "--environment", "pbs")], job_env(), tmp_path)
    one_error(result, "cannot read PBS_NODEFILE=")
    assert result.returncode == 2


def test_pbs_ranks_not_divisible_by_nodes(tmp_path, corpus):
    (tmp_path / "nodefile").write_text(f"localhost\n{socket.gethostname()}\n")  # two "nodes", both this one
    result = run_session([mpiexec(), "-n", "3", *training(corpus, "--environment", "pbs")],
                         job_env(PBS_NODEFILE=str(tmp_path / "nodefile")), tmp_path)
    one_error(result, "3 rank(s) cannot be spread evenly over the 2 node(s)")


def test_an_error_on_one_rank_only_ends_the_mpi_job(tmp_path, corpus):
    """Rank 1 alone cannot read its PBS_NODEFILE while rank 0 goes on to the rendezvous: rank 1 says so and
    aborts the job instead of leaving rank 0 waiting."""
    (tmp_path / "nodefile").write_text(socket.gethostname() + "\n")
    pbs = training(corpus, "--environment", "pbs")
    cmd = [mpiexec(), "-n", "1", "env", f"PBS_NODEFILE={tmp_path / 'nodefile'}", *pbs,
           ":", "-n", "1", "env", f"PBS_NODEFILE={tmp_path / 'missing'}", *pbs]
    result = run_session(cmd, job_env(), tmp_path)
    one_error(result, f"rank 1: --environment pbs: cannot read PBS_NODEFILE={tmp_path / 'missing'}")


def slurm_job(tmp_path, tasks, **extra):
    return job_env(**install_fakes(tmp_path / "bin"), SLURM_JOB_ID="4242", SLURM_NTASKS=str(tasks),
                   SLURM_JOB_NODELIST=socket.gethostname(), **extra)


def test_reserved_port_in_use_ends_the_srun_step(tmp_path, corpus, held_port):
    """Rank 0 cannot bind the step's reserved port; --kill-on-bad-exit ends the tasks that wait for it."""
    cmd = ["srun", "--mpi=none", "--kill-on-bad-exit=1", *training(corpus)]
    result = run_session(cmd, slurm_job(tmp_path, 2, SLURM_STEP_RESV_PORTS=f"{held_port}-{held_port + 3}"), tmp_path)
    one_error(result, f"rank 0: SLURM_STEP_RESV_PORTS's port {held_port} is already in use")


def test_a_rank_never_joins_another_jobs_store(tmp_path, corpus):
    """Another job's rank 0 holds the store on this step's port: rank 1 sees its token and stops."""
    theirs = dist.TCPStore("0.0.0.0", 0, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    theirs.set("minimal_fsdp/launch_token", "slurm 3492.0.0")
    env = slurm_job(tmp_path, 2, SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2",
                    SLURM_STEP_NUM_NODES="1", SLURM_STEP_RESV_PORTS=str(theirs.port))
    result = run_session(training(corpus), env, tmp_path)
    one_error(result, f"rank 1: the rendezvous at 127.0.0.1:{theirs.port} belongs to another job (slurm 3492.0.0, "
                      "expected slurm 4242.0.0)")


def test_uneven_ranks_per_node_with_hybrid_sharding(tmp_path, corpus):
    """4 tasks laid out 2,1,1 over three nodes: every rank refuses the hybrid mesh alike, one line."""
    cmd = ["srun", "--mpi=none", "--kill-on-bad-exit=1", *training(corpus, "--sharding", "hybrid-full-shard")]
    result = run_session(cmd, slurm_job(tmp_path, 4, FAKE_TASKS_PER_NODE="2,1,1"), tmp_path)
    one_error(result, "nodes run different numbers of ranks (1, 2)")
    assert result.returncode == 2


def test_pod_level_world_without_torchrun(tmp_path, corpus):
    """`python basic_training.py` in a PyTorchJob pod, torchrun forgotten: one line, not a wait for 8 ranks."""
    env = job_env(RANK="0", WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="23456", PET_NPROC_PER_NODE="4")
    result = run_session(training(corpus), env, tmp_path)
    one_error(result, "start basic_training.py with torchrun")
    assert result.returncode == 2
