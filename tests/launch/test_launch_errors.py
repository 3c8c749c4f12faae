"""Launch failures seen on real clusters, faked here: the launcher's variables set by hand, a
stand-in srun, a port held by the test. Each ends every process of the job with one `error:` line
and a non-zero exit; run_session fails the test if any process is left behind (the timeouts only
catch a hang)."""

import datetime
import os
import shlex
import shutil
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from minimal_fsdp.launch import hosts, rendezvous

from conftest import ENTRY, ROOT, TINY_MODEL, mpiexec
from fake_launchers import error_lines, install_fakes, run_session

# Variables of the launcher that runs pytest (a test may itself run under one) that would mislead
# the job.
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_FD",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "PALS_RANKID",
    "PBS_NODEFILE",
)


def job_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")
    }
    return dict(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def training(corpus, *extra):
    return [
        sys.executable,
        str(ENTRY),
        "--dataset",
        "text",
        "--input_file",
        str(corpus),
        *TINY_MODEL,
        "--max_steps",
        "2",
        "--eval_interval",
        "0",
        "--collective_timeout",
        "120",
        *extra,
    ]


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


@pytest.mark.slow  # in process: test_launchers.py
def test_mpi4py_of_another_mpi_is_not_a_silent_world_of_one(tmp_path, corpus):
    """Cray's mpiexec (PALS) starting ranks whose mpi4py comes from the mpich wheel: MPI_Init gives
    each process a world of its own. Both stop; the launcher's rank 0 says why."""
    train = " ".join(training(corpus))
    script = (
        f"PALS_RANKID=0 PMI_SIZE=2 {train} & first=$!; PALS_RANKID=1 PMI_SIZE=2 {train}; "
        "second=$?; wait $first; first=$?; echo exits $first $second; exit $((first | second))"
    )
    result = run_session(["bash", "-c", script], job_env(), tmp_path)
    assert "exits 2 2" in result.stdout
    line = one_error(result, "the launcher started 2 ranks but mpi4py's MPI (MPICH")
    assert "sees a world of 1" in line and "docs/launch.md" in line
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow  # the same refusal as the srun port's below (also slow)
def test_master_port_in_use_ends_the_mpi_job(tmp_path, corpus, held_port):
    result = run_session(
        [mpiexec(), "-n", "2", *training(corpus)], job_env(MASTER_PORT=str(held_port)), tmp_path
    )
    one_error(result, f"MASTER_PORT {held_port} is already in use")
    assert result.returncode == 2


@pytest.mark.slow  # in process: test_launchers.py
def test_unresolvable_master_addr_ends_the_mpi_job(tmp_path, corpus):
    result = run_session(
        [mpiexec(), "-n", "2", *training(corpus)],
        job_env(MASTER_ADDR="no-such-host.invalid"),
        tmp_path,
    )
    # alike on every rank
    one_error(result, "error: MASTER_ADDR no-such-host.invalid does not resolve")
    assert result.returncode == 2


@pytest.mark.slow  # quick: test_launchers.py, and one rank alone below
def test_pbs_without_nodefile_ends_the_mpi_job(tmp_path, corpus):
    result = run_session(
        [mpiexec(), "-n", "2", *training(corpus, "--environment", "pbs")], job_env(), tmp_path
    )
    one_error(result, "--environment pbs needs PBS_NODEFILE")
    assert result.returncode == 2


@pytest.mark.slow
def test_pbs_ranks_not_divisible_by_nodes(tmp_path, corpus):
    # two "nodes", both this one
    (tmp_path / "nodefile").write_text(f"localhost\n{socket.gethostname()}\n")
    result = run_session(
        [mpiexec(), "-n", "3", *training(corpus, "--environment", "pbs")],
        job_env(PBS_NODEFILE=str(tmp_path / "nodefile")),
        tmp_path,
    )
    one_error(result, "3 rank(s) cannot be spread evenly over the 2 node(s)")


def test_an_error_on_one_rank_only_ends_the_mpi_job(tmp_path, corpus):
    """Rank 1 alone cannot read its PBS_NODEFILE while rank 0 goes on to the rendezvous: rank 1 says
    so and aborts the job instead of leaving rank 0 waiting."""
    (tmp_path / "nodefile").write_text(socket.gethostname() + "\n")
    pbs = training(corpus, "--environment", "pbs")
    cmd = [
        mpiexec(),
        "-n",
        "1",
        "env",
        f"PBS_NODEFILE={tmp_path / 'nodefile'}",
        *pbs,
        ":",
        "-n",
        "1",
        "env",
        f"PBS_NODEFILE={tmp_path / 'missing'}",
        *pbs,
    ]
    result = run_session(cmd, job_env(), tmp_path)
    one_error(result, f"rank 1: --environment pbs: cannot read PBS_NODEFILE={tmp_path / 'missing'}")


def slurm_job(tmp_path, tasks, **extra):
    return job_env(
        **install_fakes(tmp_path / "bin"),
        SLURM_JOB_ID="4242",
        SLURM_NTASKS=str(tasks),
        SLURM_JOB_NODELIST=socket.gethostname(),
        **extra,
    )


@pytest.mark.slow  # quick: test_an_error_on_one_rank_only_ends_the_mpi_job
def test_reserved_port_in_use_ends_the_srun_step(tmp_path, corpus, held_port):
    """Rank 0 cannot bind the step's reserved port; --kill-on-bad-exit ends the tasks that wait for
    it."""
    cmd = ["srun", "--mpi=none", "--kill-on-bad-exit=1", *training(corpus)]
    result = run_session(
        cmd, slurm_job(tmp_path, 2, SLURM_STEP_RESV_PORTS=f"{held_port}-{held_port + 3}"), tmp_path
    )
    one_error(result, f"rank 0: SLURM_STEP_RESV_PORTS's port {held_port} is already in use")


@pytest.mark.slow  # quick: test_an_error_on_one_rank_only_ends_the_mpi_job
def test_a_rank_never_joins_another_jobs_store(tmp_path, corpus):
    """Another job's rank 0 holds the store on this step's port: rank 1 sees its token and stops."""
    theirs = dist.TCPStore(
        "0.0.0.0",
        0,
        2,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    theirs.set("minimal_fsdp/launch_token", "slurm 3492.0.0")
    env = slurm_job(
        tmp_path,
        2,
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_STEP_ID="0",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_RESV_PORTS=str(theirs.port),
    )
    result = run_session(training(corpus), env, tmp_path)
    one_error(
        result,
        f"rank 1: the rendezvous at 127.0.0.1:{theirs.port} belongs to another job (slurm "
        "3492.0.0, expected slurm 4242.0.0)",
    )


@pytest.mark.slow
def test_uneven_ranks_per_node_with_hybrid_sharding(tmp_path, corpus):
    """4 tasks laid out 2,1,1 over three nodes: every rank refuses the hybrid mesh alike, one
    line."""
    cmd = [
        "srun",
        "--mpi=none",
        "--kill-on-bad-exit=1",
        *training(corpus, "--sharding", "hybrid-full-shard"),
    ]
    # Three pretend hosts are this one: rank 0's address must be one the "others" reach
    # off loopback.
    address = next((str(i.ip) for i in hosts.interfaces().values() if not i.ip.is_loopback), None)
    if address is None:
        pytest.skip("no network interface besides loopback")
    result = run_session(
        cmd, slurm_job(tmp_path, 4, FAKE_TASKS_PER_NODE="2,1,1", MASTER_ADDR=address), tmp_path
    )
    one_error(result, "nodes run different numbers of ranks (1, 2)")
    assert result.returncode == 2


@pytest.mark.slow  # in process: test_launchers.py
def test_pod_level_world_without_torchrun(tmp_path, corpus):
    """`python basic_training.py` in a PyTorchJob pod, torchrun forgotten: one line, not a wait for
    8 ranks."""
    env = job_env(
        RANK="0",
        WORLD_SIZE="8",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="23456",
        PET_NPROC_PER_NODE="4",
    )
    result = run_session(training(corpus), env, tmp_path)
    one_error(result, "start basic_training.py with torchrun")
    assert result.returncode == 2


# --- the run lock: a holder is gone only when provably so ---

HOLD_LOCK = """import sys
from minimal_fsdp.launch import run_lock
lock = run_lock.RunLock({"--checkpoint_dir": sys.argv[1]})
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes stdin
lock.release()
"""


@pytest.mark.slow  # in process: test_security.py
def test_a_second_step_of_the_same_slurm_job_refuses_a_run_directory_in_use(tmp_path, corpus):
    """Two job steps of one SLURM job on one run directory: the job id is no proof that the first
    has ended, so while it lives the second refuses in one line (it used to take the lock over and
    both wrote the run)."""
    step = dict(
        SLURM_JOB_ID="4242",
        SLURM_NTASKS="1",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_STEP_NUM_TASKS="1",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_TASKS_PER_NODE="1",
    )
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "checkpoints" / "run")],
        cwd=tmp_path,
        env=job_env(**step, SLURM_STEP_ID="0"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline() == "held\n"
        second = run_session(
            training(corpus, "--run_name", "run"), job_env(**step, SLURM_STEP_ID="1"), tmp_path
        )
        line = one_error(second, "checkpoints/run is in use by another training run")
        assert f"pid {first.pid}, job 4242" in line and second.returncode == 2
        assert first.poll() is None and "step_" not in "".join(
            os.listdir(tmp_path / "checkpoints" / "run")
        )
    finally:
        first.communicate("", timeout=60)
    assert first.returncode == 0 and not (tmp_path / "checkpoints" / "run" / ".lock").exists()


# --- launch variables that describe no world, or another one than MPI's ---


def each_process(tmp_path, corpus, variables):
    """Starts one plain `python basic_training.py` per dict of variables, all at once; their
    results."""
    train = " ".join(training(corpus))
    script = "; ".join(
        f"env {' '.join(shlex.quote(f'{k}={v}') for k, v in extra.items())} {train} 2>err{i} & "
        f"p{i}=$!"
        for i, extra in enumerate(variables)
    )
    script += "; " + "; ".join(
        f"wait $p{i}; echo exit $?; cat err{i}" for i in range(len(variables))
    )
    result = run_session(["bash", "-c", script], job_env(), tmp_path, timeout=180)
    return [part.splitlines() for part in result.stdout.split("exit ")[1:]]


def refused_alike(results, expected):
    """Every process exited 2 with one `error:` line containing `expected`, and nothing else went
    wrong."""
    for lines in results:
        errors = [line for line in lines if line.startswith("error: ")]
        assert lines[0] == "2" and len(errors) == 1 and expected in errors[0], "\n".join(lines)
        assert not any("Traceback" in line or "Abort" in line for line in lines), "\n".join(lines)
    return results


@pytest.mark.slow  # in process: test_launchers.py
def test_cray_pals_variables_without_pmi_stop_every_process(tmp_path, corpus):
    """PALS_RANKID on plain python processes, no PMI_SIZE: rank 0 used to train alone and rank 1 to
    exit 2 silently. Neither can know the world size: both refuse, before MPI_Init."""
    pals = [
        dict(PALS_RANKID=str(rank), PALS_LOCAL_RANKID=str(rank), PALS_NODEID="0") for rank in (0, 1)
    ]
    refused_alike(each_process(tmp_path, corpus, pals), "but no PMI_SIZE: Cray's mpiexec sets both")
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow  # in process: test_launchers.py
def test_open_mpi_5_pmix_variables_with_an_mpich_mpi4py_say_so_before_mpi_init(tmp_path, corpus):
    """What Open MPI 5's mpirun sets in its ranks; the mpich wheel's MPI_Init would abort with a
    stack per rank (exit 16). Each rank says why in one line instead, before MPI_Init."""
    ranks = [
        dict(
            PMIX_RANK=str(rank),
            PMIX_NAMESPACE="prterun-host-1234@1",
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_SIZE="2",
            PMIX_SERVER_URI41="prterun-host-1234@0.0;tcp4://127.0.0.1:1",
        )
        for rank in (0, 1)
    ]
    refused_alike(
        each_process(tmp_path, corpus, ranks),
        "a PMIx launcher (Open MPI's mpirun or prterun) started this rank, but mpi4py's MPI (MPICH",
    )


@pytest.mark.slow  # quick: test_an_error_on_one_rank_only_ends_the_mpi_job
def test_a_pmi_fd_that_is_no_launchers_socket_is_one_line_before_mpi_init(tmp_path, corpus):
    """Hydra's variables copied into processes it did not start: PMI_FD names no socket, and MPICH's
    MPI_Init used to abort with its error stack and no `error:` line."""
    ranks = [dict(PMI_FD="99", PMI_RANK=str(rank), PMI_SIZE="2") for rank in (0, 1)]
    refused_alike(
        each_process(tmp_path, corpus, ranks), "PMI_FD=99 is not an open socket to an MPI launcher"
    )


@pytest.mark.slow
def test_slurm_variables_that_describe_no_step_stop_every_task(tmp_path, corpus):
    """Tasks with srun's step variables but no SLURM_LOCALID would all take local rank 0 (on a GPU
    node, GPU 0); processes with the job's SLURM_PROCID but no step variables would each train alone
    and fight over the run lock. Each refuses in one line."""
    job = dict(SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_JOB_NODELIST=socket.gethostname())
    step = dict(
        job,
        SLURM_STEP_ID="0",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_NODEID="0",
    )
    refused_alike(
        each_process(tmp_path, corpus, [dict(step, SLURM_PROCID=str(r)) for r in (0, 1)]),
        "SLURM_LOCALID is not set but srun's step variables are",
    )
    results = each_process(tmp_path, corpus, [dict(job, SLURM_PROCID="1", SLURM_LOCALID="1")])
    refused_alike(results, "SLURM_PROCID=1 without srun's step variables")


@pytest.mark.parametrize("script", ["train_single_node.sh", "train_multi_node.sh"])
def test_pbs_scripts_stop_on_a_nodefile_that_does_not_exist(tmp_path, script):
    """The scripts used to count 0 nodes and run `mpiexec -n 0` (set -e is off inside `source ... ||
    ...`)."""
    (tmp_path / "mpiexec").write_text("#!/bin/sh\ntouch ran\n")
    (tmp_path / "mpiexec").chmod(0o755)
    env = job_env(
        PBS_NODEFILE=str(tmp_path / "gone"),
        REPO=str(ROOT),
        MPIEXEC=str(tmp_path / "mpiexec"),
        CONDA_PREFIX="skip-the-module",
    )
    result = run_session(["bash", str(ROOT / "pbs" / script)], env, tmp_path, timeout=60)
    one_error(result, f"PBS_NODEFILE={tmp_path / 'gone'} does not exist")
    assert result.returncode == 2 and not (tmp_path / "ran").exists()


@pytest.mark.slow  # in process: test_launchers.py
def test_torchrun_variables_inside_an_mpiexec_launch_are_refused(tmp_path, corpus):
    """A PyTorchJob pod's RANK=0 and WORLD_SIZE seen by every rank of an mpiexec: the torchrun rule
    used to win, every rank took rank 0, one died of address-in-use and the other waited. Two
    sources disagree: one line."""
    env = job_env(
        RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous._free_port())
    )
    result = run_session([mpiexec(), "-n", "2", *training(corpus)], env, tmp_path, timeout=180)
    line = one_error(
        result,
        "rank 1: two sources of rank information disagree: RANK=0 (torchrun/PyTorchJob) but "
        "MPI's rank is 1",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, line


@pytest.mark.slow  # quick: test_an_error_on_one_rank_only_ends_the_mpi_job
def test_a_nodefile_that_mpi_does_not_see_is_refused(tmp_path, corpus):
    """PBS_NODEFILE lists two hosts, but mpiexec ran both ranks on this one (no host file given to
    it): the launcher's view and MPI's own disagree on ranks per host, so the run refuses instead of
    picking one."""
    # two "nodes", both this one
    (tmp_path / "nodefile").write_text(f"localhost\n{socket.gethostname()}\n")
    result = run_session(
        [mpiexec(), "-hosts", "localhost", "-n", "2", *training(corpus, "--environment", "pbs")],
        job_env(PBS_NODEFILE=str(tmp_path / "nodefile")),
        tmp_path,
        timeout=180,
    )
    one_error(
        result, "PBS_NODEFILE lists 2 node(s) x 1 rank(s) but MPI finds 1 host(s) with 2 rank(s)"
    )
    assert result.returncode == 2


# --- a rank that never arrives, an address nobody answers at ---


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, words",
    [
        # srun's variables: rank 0's own store; the process group's wait for rank 1's key
        ("srun", "(wait timeout after 10000ms, keys: "),
        # torchrun's (its agent's store is c10d's env:// one, which waits for the clients)
        ("torchrun", " seconds waiting for clients. 1/2 clients joined.)"),
    ],
)
def test_a_rank_that_never_starts_ends_rank_0_in_one_line(tmp_path, corpus, launcher, words):
    """A world of 2 whose rank 1 never started: rank 0 waits for it at the process group for
    --collective_timeout, then ends with docs/launch.md's line for a rank that never arrived, and
    nothing else on stderr (no c10d warning from the timed-out store wait: TORCH_CPP_LOG_LEVEL)."""
    train = training(corpus)
    train[train.index("--collective_timeout") + 1] = "10"
    if launcher == "srun":
        env = dict(
            SLURM_JOB_ID="4243",
            SLURM_STEP_ID="0",
            SLURM_PROCID="0",
            SLURM_LOCALID="0",
            SLURM_NODEID="0",
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_NUM_NODES="1",
            SLURM_STEP_TASKS_PER_NODE="2",
            SLURM_STEP_NODELIST=socket.gethostname(),
        )
    else:
        env = dict(
            RANK="0",
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(rendezvous._free_port()),
            TORCHELASTIC_RUN_ID="none",
        )
    result = run_session(train, job_env(**env), tmp_path, timeout=180)  # a bound on a hang only
    line = one_error(result, "rank 0: a collective waited longer than --collective_timeout: ")
    assert words in line, line
    assert [x for x in result.stderr.splitlines() if x.strip()] == [line]


STOPS_IN_MPI = "from mpi4py import MPI; import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"


@pytest.mark.slow
def test_a_rank_missing_from_mpi_discovery_does_not_hold_the_others(tmp_path, corpus):
    """Rank 2 never calls MPI_Init (it sleeps), rank 3 stops right after it: the training ranks wait
    in MPI's discovery, which --collective_timeout used not to cover. Each says so in one line and
    the job ends."""
    train = training(corpus)
    train[train.index("--collective_timeout") + 1] = "15"
    cmd = [
        mpiexec(),
        "-n",
        "2",
        *train,
        ":",
        "-n",
        "1",
        sys.executable,
        "-c",
        "import time; time.sleep(600)",
        ":",
        "-n",
        "1",
        sys.executable,
        "-c",
        STOPS_IN_MPI,
    ]
    result = run_session(cmd, job_env(), tmp_path, timeout=240)
    errors = error_lines(result)
    # Each training rank watches for itself; the launcher may end the second before its own
    # watch fires.
    assert result.returncode != 0 and 1 <= len(errors) <= 2, result.stderr[-3000:]
    assert len({line.split(":")[1] for line in errors}) == len(errors)  # at most one line per rank
    assert all(
        "MPI discovery (MPI_Init and the split by host) did not finish within 15s" in e
        for e in errors
    )
    assert "Traceback" not in result.stderr


STOPS_AFTER_PUBLISHING = """import os, runpy, signal, sys
if os.environ["SLURM_PROCID"] == "0":  # rank 0 stops right after publishing its rendezvous port
    from minimal_fsdp.launch import rendezvous
    real = os.replace
    def replace_then_stop(source, target):
        real(source, target)
        if os.path.basename(os.path.dirname(target)) == ".rendezvous":
            os.kill(os.getpid(), signal.SIGSTOP)
    rendezvous.os.replace = replace_then_stop
sys.argv[0] = {entry!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_rank_0_stopped_after_publishing_its_port_does_not_hold_the_others(tmp_path, corpus):
    """srun-style tasks; rank 0 publishes its port and stops. Rank 1's store client waited for rank
    0's answer with no timeout, silently; now every wait before the process group exists is under
    --collective_timeout."""
    wrapper = tmp_path / "stops.py"
    wrapper.write_text(STOPS_AFTER_PUBLISHING.format(entry=str(ENTRY)))
    train = training(corpus)
    train[train.index("--collective_timeout") + 1] = "10"
    train[1] = str(wrapper)
    result = run_session(
        ["srun", "--mpi=none", "--kill-on-bad-exit=1", *train],
        slurm_job(tmp_path, 2),
        tmp_path,
        timeout=120,
    )  # a bound on a hang only
    one_error(
        result,
        "rank 1: the rendezvous (joining rank 0's store and the process group) did not finish "
        "within 10s (--collective_timeout)",
    )
    assert "Traceback" not in result.stderr


def in_network_namespace(cmd):
    """cmd in a network namespace of its own (and a user namespace, for the rights): loopback up,
    and a route that sends the TEST-NET 192.0.2.0/24 into loopback, where nothing answers. No packet
    leaves this machine."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs unshare and ip")
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no user network namespaces here: {probe.stderr.decode().strip()}")
    setup = "ip link set lo up && ip route add 192.0.2.0/24 dev lo && exec \"$@\""
    return ["unshare", "-rn", "bash", "-c", setup, "netns", *cmd]


@pytest.mark.slow
def test_an_unreachable_master_addr_ends_the_mpi_job_in_one_line(tmp_path, corpus):
    """MASTER_ADDR routable but with no host behind it: no output for minutes, then c10d frames, it
    used to be. Every rank tries one plain connection first, bounded by --collective_timeout: one
    line."""
    train = training(corpus)
    train[train.index("--collective_timeout") + 1] = "10"
    result = run_session(
        in_network_namespace([mpiexec(), "-n", "2", *train]),
        job_env(MASTER_ADDR="192.0.2.1"),
        tmp_path,
        timeout=180,
    )
    line = one_error(result, "cannot reach the rendezvous at 192.0.2.1:")
    assert "no answer within 10s" in line and result.returncode == 2
    # No c10d frames (the namespace has no DNS, so c10d's one warning about naming a client
    # may appear).
    assert "Traceback" not in result.stderr and "frame #" not in result.stderr
    assert not [
        line
        for line in result.stderr.splitlines()
        if "c10d" in line and "cannot be retrieved" not in line
    ]


@pytest.mark.slow  # in process: test_launchers.py
def test_an_unresolvable_master_addr_under_torchrun_variables_is_one_line(tmp_path, corpus):
    """A worker with torchrun's (or a PyTorchJob's) variables and a MASTER_ADDR that no name server
    knows: it used to retry for --collective_timeout and end in tracebacks."""
    env = job_env(
        RANK="1",
        WORLD_SIZE="2",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        TORCHELASTIC_RUN_ID="none",
        MASTER_ADDR="master-0.no-such-job.invalid",
        MASTER_PORT="23456",
    )
    result = run_session(training(corpus), env, tmp_path, timeout=120)
    one_error(result, "MASTER_ADDR master-0.no-such-job.invalid does not resolve on")
    assert result.returncode == 2 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_two_ranks_claiming_one_local_rank_on_one_node_are_refused_at_the_first_gather(
    tmp_path, corpus
):
    """RANK/WORLD_SIZE/LOCAL_* exported by hand with LOCAL_RANK=0 in both processes of one host:
    both used to take local rank 0 (one GPU). Each rank sees only its own variables, so the clash is
    found at the first collective, which gathers every rank's host and local rank: every rank ends
    alike, and rank 0 says it once."""
    world = dict(
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(rendezvous._free_port()),
    )
    results = each_process(tmp_path, corpus, [dict(world, RANK=str(rank)) for rank in (0, 1)])
    assert [lines[0] for lines in results] == ["2", "2"], results
    errors = [line for lines in results for line in lines if line.startswith("error: ")]
    assert errors == [
        "error: ranks 0 and 1 both have LOCAL_RANK=0 on one node: they would share its GPU and its "
        "share of cores; give each rank of a node its own local rank (torchrun and srun do; set by "
        "hand, check them)"
    ], results
    assert not any("Traceback" in line for lines in results for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_a_rank_stopped_during_a_save_ends_the_others_in_one_line(tmp_path, corpus, launcher):
    """Rank 1 stops (SIGSTOP: a host that no longer answers) while it writes its shard of step 2's
    checkpoint. Rank 0 waits in DCP's gather, then finds gloo's pair closed in the save's own
    gather: it used to print a 60-line traceback and no `error:` line. Now one line, and the job
    ends (MPI's Abort; srun's --kill-on-bad-exit)."""
    train = training(corpus, "--checkpoint_interval", "2", "--num_tokens", "0")
    train[train.index("--collective_timeout") + 1] = "10"
    train[1] = str(ROOT / "tests" / "faults.py")
    faults = dict(MINIMAL_FSDP_FAULTS="stop_in_save@2:1")
    if launcher == "mpiexec":
        result = run_session([mpiexec(), "-n", "2", *train], job_env(**faults), tmp_path)
    else:
        cmd = ["srun", "--mpi=none", "--kill-on-bad-exit=1", *train]
        result = run_session(cmd, slurm_job(tmp_path, 2, **faults), tmp_path)
    # which collective, at which step, and the rank that never joined it (launch/hangs.py)
    line = one_error(result, "rank 0: a collective waited longer than --collective_timeout: ")
    assert "rank 1 never joined it" in line and "(Timed out waiting 10000ms" in line, line
    assert "Traceback" not in result.stderr, line
    assert not (tmp_path / "checkpoints" / "corpus" / "step_2").exists()


# --- commands under a launcher's several ranks ---


def test_a_command_of_one_process_runs_on_rank_0_only(monkeypatch, capsys):
    """`mpiexec -n 2 minimal-fsdp export` made every rank do the whole export into one folder; now
    rank 0 runs it and the other ranks exit at once, before parsing or importing anything."""
    import importlib

    from minimal_fsdp import __main__ as cli

    ran = []
    stub = type("Module", (), {"main": staticmethod(lambda cfg: ran.append(cfg.out))})
    monkeypatch.setattr(importlib, "import_module", lambda name: stub)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(SystemExit) as ended:
        cli.main(["export", "checkpoints/run", "exported"])
    assert ended.value.code == 0 and ran == [] and capsys.readouterr() == ("", "")
    monkeypatch.setenv("PMI_RANK", "0")
    cli.main(["export", "checkpoints/run", "exported"])
    assert ran == ["exported"]


def test_an_unknown_command_under_mpiexec_is_said_once(tmp_path):
    """It was said by every rank, the lines glued into one."""
    result = run_session(
        [mpiexec(), "-n", "2", sys.executable, "-m", "minimal_fsdp", "trian"], job_env(), tmp_path
    )
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: no command 'trian'; commands: train, sample, evaluate, export, prepare, progress, "
        "plan, cluster, plot"
    ], result.stderr
