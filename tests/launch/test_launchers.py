"""Every launcher script, run for real on CPU: the PBS job scripts under a faked PBS job (this host
in PBS_NODEFILE, the mpich wheel's mpiexec), the sbatch script with a stand-in srun, and the
Kubernetes manifest's torchrun command. Plus srun detection from faked SLURM variables."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minimal_fsdp.config.checks import validate_world
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.launch import discovery, environment, rendezvous

from conftest import ROOT, TINY_MODEL, mpiexec
from fake_launchers import install_fakes
from support import envsubst, kubelet_expand


def tiny_args(corpus, run_name, steps=3, tensorboard=False):
    return [
        "--dataset",
        "text",
        "--input_file",
        str(corpus),
        *TINY_MODEL,
        "--max_steps",
        str(steps),
        "--eval_interval",
        "0",
        "--log_interval",
        "1",
        "--run_name",
        run_name,
        "--tensorboard" if tensorboard else "--no-tensorboard",
    ]


def run_script(cmd, tmp_path, env, timeout=240):
    full_env = dict(
        os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHON=sys.executable, **env
    )
    result = subprocess.run(
        cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, (
        f"{cmd} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result


def trained(tmp_path, run_name, steps=3):
    """The run left a complete checkpoint and one metrics row per step."""
    assert (tmp_path / "checkpoints" / run_name / "latest").read_text().strip() == f"step_{steps}"
    rows = [
        json.loads(line)
        for line in (tmp_path / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))


def pbs_job(tmp_path, script, nodes, ranks_per_node, args):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{host}\n" for host in nodes for _ in range(ranks_per_node)))
    env = {
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": "1234.test",
        "PBS_O_WORKDIR": str(tmp_path),
        "REPO": str(ROOT),
        "MPIEXEC": mpiexec(),
        "NRANKS_PER_NODE": str(ranks_per_node),
        "NDEPTH": "1",
        # Hydra's mpiexec knows --ppn but not Cray's --depth
        "CPU_BIND": "",
        "ARGS": " ".join(args),
    }
    return run_script(["bash", str(ROOT / "pbs" / script)], tmp_path, env)


@pytest.mark.slow
def test_pbs_scripts_train_and_generate(tmp_path, corpus):
    out = pbs_job(
        tmp_path, "train_single_node.sh", [socket.gethostname()], 2, tiny_args(corpus, "single")
    )
    assert (
        "1 node(s) x 2 rank(s) = 2 rank(s)" in out.stdout
        and "mesh shard=2 (full-shard)" in out.stdout
    )
    trained(tmp_path, "single")
    # Two "nodes" that are both this machine: Hydra starts one proxy per PBS_NODEFILE host. One rank
    # per node keeps the test cheap; test_end_to_end runs the 2 x 2 hybrid mesh.
    out = pbs_job(
        tmp_path,
        "train_multi_node.sh",
        ["localhost", socket.gethostname()],
        1,
        tiny_args(corpus, "multi"),
    )
    assert "2 node(s) x 1 rank(s)/node" in out.stdout
    assert "mesh replicate=2 x shard=1 (hybrid-full-shard)" in out.stdout
    trained(tmp_path, "multi")
    out = pbs_job(
        tmp_path,
        "generate.sh",
        [socket.gethostname()],
        1,
        ["--run_name", "multi", "--prompt", "KING:", "--num_tokens", "25"],
    )
    assert "generating from checkpoints/multi/step_3" in out.stdout
    sample = out.stdout.split("-" * 40 + "\n")[1]
    assert sample.startswith("KING:") and len(sample.rstrip("\n")) == len("KING:") + 25
    # nothing trained
    assert (tmp_path / "checkpoints" / "multi" / "latest").read_text().strip() == "step_3"


@pytest.mark.slow
def test_sbatch_script_trains_under_srun(tmp_path, corpus):
    # What sbatch gives the batch script: note SLURM_PROCID=0 and SLURM_NTASKS=2 in this
    # one process.
    env = {
        **install_fakes(tmp_path / "bin"),
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": socket.gethostname(),
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "ENTRY": str(ROOT / "basic_training.py"),
    }
    out = run_script(
        ["bash", str(ROOT / "slurm" / "train.sbatch"), *tiny_args(corpus, "slurm")], tmp_path, env
    )
    assert "launch: 2 rank(s) = 1 node(s) x 2 rank(s)/node, started by srun" in out.stdout
    srun_argv = json.loads((tmp_path / "bin" / "srun.log").read_text())
    assert "--mpi=none" in srun_argv and "--kill-on-bad-exit=1" in srun_argv
    trained(tmp_path, "slurm")
    # Rank 0 bound a free port and published it for this step only; the file is gone once all
    # had joined.
    assert list((tmp_path / "checkpoints" / ".rendezvous").iterdir()) == []


@pytest.mark.slow
def test_srun_without_mpi_none_on_a_pmix_cluster_trains(tmp_path, corpus):
    """srun's PMIx plugin sets PMIX_RANK in every task: the tasks are srun's (its namespace names
    the step), so MPI is never initialized; the mpich wheel would see a world of one per task."""
    env = {
        **install_fakes(tmp_path / "bin"),
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": socket.gethostname(),
    }
    cmd = [
        "srun",
        "--mpi=pmix",
        sys.executable,
        str(ROOT / "basic_training.py"),
        *tiny_args(corpus, "pmix", 2),
    ]
    out = run_script(cmd, tmp_path, env)
    assert "launch: 2 rank(s) = 1 node(s) x 2 rank(s)/node, started by srun" in out.stdout
    trained(tmp_path, "pmix", steps=2)


@pytest.mark.slow
def test_kubernetes_manifest_runs_torchrun(tmp_path, corpus):
    yaml = pytest.importorskip("yaml")
    template = (ROOT / "k8s" / "pytorchjob.yaml").read_text()
    values = {
        "JOB_NAME": "tiny",
        "IMAGE_URI": "minimal_fsdp:test",
        "NUM_WORKERS": "0",
        "GPU_PER_NODE": "2",
        "INSTANCE_TYPE": "cpu",
        "SHARED_PVC": "claim",
        "SHARED_DIR": str(tmp_path),
        "TRAINING_ARGS": " ".join(tiny_args(corpus, "k8s", tensorboard=True)),
    }
    # every placeholder is one we document
    assert set(re.findall(r"\$\{(\w+)\}", template)) == set(values)
    for name in values:
        assert f"export {name}=" in template or f" {name}=" in template, name
    job = yaml.safe_load(envsubst(template, values))
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 0
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert (
        container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == 2
    )
    # What the training operator and kubelet do in the pod: fill in $(NAME) from the
    # pod's variables.
    pod_env = {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        "PET_NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(rendezvous._free_port()),
    }
    command = kubelet_expand(container["args"][0], pod_env)
    assert "torchrun " in command and "--nproc_per_node=2" in command
    torchrun_dir = Path(sys.executable).parent  # the torchrun beside this Python
    # An operator that sets no PET_* variables: kubelet leaves $(PET_NNODES) as it is; one line,
    # exit 2.
    bare = subprocess.run(
        [*container["command"], kubelet_expand(container["args"][0], {})],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k not in pod_env},
    )
    assert bare.returncode == 2 and bare.stderr.startswith(
        "error: the training operator did not set PET_NNODES"
    )
    assert bare.stderr.count("\n") == 1
    out = run_script(
        [*container["command"], command],
        ROOT,
        {"PATH": f"{torchrun_dir}:{os.environ['PATH']}", **pod_env},
    )
    assert "launch: 2 rank(s) = 1 node(s) x 2 rank(s)/node, started by torchrun" in out.stdout
    trained(tmp_path, "k8s")
    assert len(list((tmp_path / "logs" / "k8s").glob("events.out.tfevents.*"))) == 1  # rank 0 only


# Discovery from the environment alone (no real SLURM, PBS or Kubernetes here).
SLURM_TASK = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "4,3",
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_NTASKS": "7",
}
LAUNCH_VARIABLES = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    *discovery.MPI_RANK_VARIABLES,
    *discovery.MPI_SIZE_VARIABLES,
    "PMIX_NAMESPACE",
    *SLURM_TASK,
    "SLURM_TASKS_PER_NODE",
    "SLURM_NNODES",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_RESV_PORTS",
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
]


def discovered():
    """(rank, world, local rank, local world, nodes, launcher) as setup finds them from
    os.environ."""
    launcher = discovery.launcher_of(os.environ)
    return (*discovery.discover(launcher, os.environ), launcher)


@pytest.fixture
def fake_env(monkeypatch):
    """os.environ without any launcher's variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_pbs_layout_refuses_a_missing_unreadable_or_uneven_nodefile(fake_env, tmp_path):
    """--environment pbs: no PBS_NODEFILE, one that cannot be read, or ranks that do not divide
    over its hosts is one line each, naming the way out (test_launch_errors.py: the same under
    mpiexec, rank 1 alone failing)."""
    with pytest.raises(ConfigError, match=r"--environment pbs needs PBS_NODEFILE \(run inside"):
        discovery.pbs_layout(2)
    fake_env.update(PBS_NODEFILE=str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match="cannot read PBS_NODEFILE=.*gone: No such file"):
        discovery.pbs_layout(2)
    (tmp_path / "gone").write_text("x1001c0s0b0n0.hsn.cm.polaris.alcf.anl.gov\nx1001c0s0b0n1\n")
    assert discovery.pbs_layout(4) == (2, 2)
    with pytest.raises(ConfigError, match=r"3 rank\(s\) cannot be spread evenly over the 2 node"):
        discovery.pbs_layout(3)


def test_srun_task_variables(fake_env):
    fake_env.update(SLURM_TASK)
    assert discovered() == (5, 7, 1, 3, 2, "srun")
    # No port derived from the job id (jobs 750 ids apart shared one): rank 0 binds a free port,
    # publishes it.
    assert rendezvous._srun_address(fake_env) == ("gpu07", 0, None)


def test_srun_rendezvous_port_exported_or_reserved(fake_env):
    fake_env.update(SLURM_TASK, SLURM_STEP_RESV_PORTS="12000-12003")
    assert rendezvous._srun_address(fake_env) == ("gpu07", 12000, "SLURM_STEP_RESV_PORTS's port")
    fake_env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert rendezvous._srun_address(fake_env) == ("10.0.0.1", 29500, "MASTER_PORT")


def test_srun_on_one_node_rendezvous_locally(fake_env):
    fake_env.update(
        SLURM_TASK, SLURM_STEP_NUM_NODES="1", SLURM_STEP_TASKS_PER_NODE="7", SLURM_NODEID="0"
    )
    assert discovered() == (5, 7, 1, 7, 1, "srun")
    assert rendezvous._srun_address(fake_env)[0] == "127.0.0.1"


def test_srun_falls_back_to_the_jobs_tasks_per_node(fake_env):
    fake_env.update(SLURM_TASK, SLURM_TASKS_PER_NODE="4,3")
    del fake_env["SLURM_STEP_TASKS_PER_NODE"]
    assert discovered() == (5, 7, 1, 3, 2, "srun")


def test_batch_script_alone_is_one_rank(fake_env):
    """A batch script has SLURM_PROCID=0 and SLURM_NTASKS but is one process: no step variables, no
    srun."""
    fake_env.update(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_JOB_ID="77")
    assert discovered()[:2] == (0, 1)


def test_mpi_wins_over_slurm_variables(fake_env, monkeypatch):
    """mpiexec inside a SLURM job: the ranks inherit SLURM_* of the job, but MPI knows the real
    layout. Hydra started by srun's PMIx plugin passes srun's PMIx variables on to its ranks:
    PMI_RANK still says MPI."""
    monkeypatch.setattr(discovery, "_discover_mpi", lambda *args: (3, 4, 3, 4, 1))
    fake_env.update(SLURM_TASK, PMI_RANK="3")
    assert discovered() == (3, 4, 3, 4, 1, "mpi")
    fake_env.update(PMIX_RANK="1", PMIX_NAMESPACE="slurm.pmix.77.0")
    assert discovered() == (3, 4, 3, 4, 1, "mpi")


def test_srun_pmix_plugin_variables_mean_srun(fake_env, monkeypatch):
    monkeypatch.setattr(
        discovery,
        "_discover_mpi",
        lambda *args: pytest.fail("MPI initialized under srun --mpi=pmix"),
    )
    fake_env.update(SLURM_TASK, PMIX_RANK="5", PMIX_NAMESPACE="slurm.pmix.77.0")
    assert discovered() == (5, 7, 1, 3, 2, "srun")
    # another launcher's namespace: MPI's ranks
    fake_env.update(PMIX_NAMESPACE="prterun-host-1234@1")
    monkeypatch.setattr(discovery, "_discover_mpi", lambda *args: (5, 7, 1, 3, 2))
    assert discovered()[-1] == "mpi"


@pytest.mark.parametrize(
    "variables,size",
    [
        ({"PALS_RANKID": "0", "PMI_SIZE": "4"}, 4),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8"}, 8),
        ({"PMIX_RANK": "3"}, 4),
        ({"PMIX_RANK": "0"}, 1),
    ],
)
def test_launcher_world_size(variables, size):
    assert discovery._launcher_world_size(variables) == size


def test_pod_level_world_without_torchrun_is_refused(fake_env):
    """A PyTorchJob pod's RANK/WORLD_SIZE are per pod; without torchrun (no LOCAL_RANK) they are
    refused."""
    fake_env.update(
        RANK="1",
        WORLD_SIZE="8",
        MASTER_ADDR="master-0",
        MASTER_PORT="23456",
        PET_NPROC_PER_NODE="4",
    )
    with pytest.raises(ConfigError, match="start basic_training.py with torchrun"):
        discovered()
    fake_env.update(LOCAL_RANK="2", LOCAL_WORLD_SIZE="4")  # what torchrun adds
    # not a wait, then tracebacks
    with pytest.raises(ConfigError, match="MASTER_ADDR master-0 does not resolve on"):
        discovered()
    fake_env.update(MASTER_ADDR="127.0.0.1")
    assert discovered() == (1, 8, 2, 4, 2, "torchrun")


def test_one_process_per_pod_is_one_node_each(fake_env):
    """A PyTorchJob with one process per pod and no LOCAL_WORLD_SIZE: each pod is a node of one rank
    (the local world used to default to WORLD_SIZE: one node of 2, both ranks local rank 0 of 2)."""
    fake_env.update(
        RANK="1",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="23456",
        PET_NNODES="2",
        PET_NPROC_PER_NODE="1",
    )
    assert discovered() == (1, 2, 0, 1, 2, "torchrun")
    del fake_env["PET_NPROC_PER_NODE"]  # the node count alone says the same
    assert discovered() == (1, 2, 0, 1, 2, "torchrun")


def test_a_literal_launcher_reference_is_one_line(fake_env):
    fake_env.update(RANK="0", WORLD_SIZE="$(PET_NNODES)", MASTER_ADDR="master-0", LOCAL_RANK="0")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='\$\(PET_NNODES\)' is not a number"):
        discovered()


NODEFILES = {
    "repeated": "x1\nx1\nx2\nx2\n",
    "blank lines": "x1\n\n x2 \n\n",
    "fqdn and short": "x1.hsn.cm.example.org\nx1\nX2.example.org\nx2\n",
    "crlf": "x1\r\nx2\r\nx3\r\n",
    "addresses": "10.0.0.1\n10.0.0.2\n10.0.0.1\n",
}


@pytest.mark.parametrize("name", NODEFILES)
def test_pbs_node_count_agrees_with_common_sh(tmp_path, name):
    nodefile = tmp_path / "nodefile"
    nodefile.write_bytes(NODEFILES[name].encode())
    shell = subprocess.run(
        ["bash", "-c", f"source {ROOT}/pbs/common.sh && echo $NNODES"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(
            os.environ, PBS_NODEFILE=str(nodefile), REPO=str(ROOT), CONDA_PREFIX="skip-the-module"
        ),
    )
    assert shell.returncode == 0, shell.stderr
    expected = {"repeated": 2, "blank lines": 2, "fqdn and short": 2, "crlf": 3, "addresses": 2}[
        name
    ]
    assert int(shell.stdout.split()[-1]) == discovery.count_pbs_nodes(nodefile) == expected


def source_common_sh(tmp_path, before="", **env):
    """bash sourcing pbs/common.sh in a faked PBS job, after `before` (shell functions standing in
    for `module` and `conda`); its CompletedProcess."""
    (tmp_path / "nodefile").write_text("x1\n")
    script = f"{before}\nsource {ROOT}/pbs/common.sh && echo sourced with $(command -v python)"
    environ = {
        k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX", "VENV", "AWS_OFI_NCCL")
    }
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(environ, PBS_NODEFILE=str(tmp_path / "nodefile"), REPO=str(ROOT), **env),
    )


def test_pbs_a_failed_module_load_stops_the_job(tmp_path):
    """It used to run before `set -e`: the job went on with whatever Python was on PATH."""
    shell = source_common_sh(tmp_path, "module() { return 1; }")
    assert shell.returncode == 2 and "sourced" not in shell.stdout
    assert shell.stderr.startswith("error: module load conda && conda activate base failed")


def test_pbs_a_venv_goes_on_top_of_the_conda_module(tmp_path):
    """VENV= used to skip the conda module the venv was built on (its mpi4py is the module's)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("echo activated venv\n")
    shell = source_common_sh(
        tmp_path, 'module() { echo "module $*"; }; conda() { echo "conda $*"; }', VENV=str(venv)
    )
    assert shell.returncode == 0, shell.stderr
    steps = [
        line
        for line in shell.stdout.splitlines()
        if line.split()[0] in ("module", "conda", "activated")
    ]
    assert steps == [
        "module use /soft/modulefiles",
        "module load conda",
        "conda activate base",
        "activated venv",
    ]


def test_pbs_the_job_log_says_which_network_nccl_uses(tmp_path):
    """A moved OFI plugin used to make NCCL fall back to TCP without a word."""
    plugin = tmp_path / "aws-ofi-nccl" / "lib"
    plugin.mkdir(parents=True)
    found = source_common_sh(tmp_path, AWS_OFI_NCCL=str(plugin), CONDA_PREFIX="skip-the-module")
    gone = source_common_sh(
        tmp_path, AWS_OFI_NCCL=str(tmp_path / "moved"), CONDA_PREFIX="skip-the-module"
    )
    assert [line for line in found.stdout.splitlines() if line.startswith("nccl: ")] == [
        f"nccl: network AWS Libfabric (Slingshot), OFI plugin in {plugin}"
    ]
    assert [line for line in gone.stdout.splitlines() if line.startswith("nccl: ")] == [
        f"nccl: network TCP sockets between nodes (no OFI plugin at {tmp_path / 'moved'}: set "
        "AWS_OFI_NCCL to its lib directory for Slingshot)"
    ]


def test_pbs_ranks_must_divide_over_the_nodes(tmp_path, monkeypatch):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\nx1\nx2\nx2\n")
    monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
    assert discovery.pbs_layout(4) == (2, 2)
    with pytest.raises(ConfigError, match="3 rank.s. cannot be spread evenly over the 2 node"):
        discovery.pbs_layout(3)


def test_hybrid_sharding_refuses_uneven_nodes():
    """Ranks laid out 2,1,1 over three nodes: each rank's own local world size would give another
    mesh."""
    cfg = parse_args(["--sharding", "hybrid-full-shard"])
    for local_world_size in (2, 1):  # the verdict does not depend on the rank that reaches it
        with pytest.raises(ConfigError, match=r"nodes run different numbers of ranks \(1, 2\)"):
            validate_world(cfg, 4, local_world_size, (2, 2, 1, 1))
    validate_world(
        parse_args(["--sharding", "hybrid-full-shard", "--shard_group_size", "2"]),
        4,
        1,
        (2, 2, 1, 1),
    )
    validate_world(parse_args(["--sharding", "full-shard"]), 4, 1, (2, 2, 1, 1))


def test_shared_gpus_are_reported():
    assert environment.shared_gpus_warning([11, 12, 13, 14]) is None
    assert environment.shared_gpus_warning([0, 0]) is None  # CPU ranks
    assert "8 ranks share 4 GPU(s)" in environment.shared_gpus_warning([1, 2, 3, 4, 1, 2, 3, 4])


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node17", "node17"),
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("nid[001234,002000-002010]", "nid001234"),
        ("rack[1-2]-n[3-4]", "rack1-n3"),
        ("a-1,b-2", "a-1"),
        ("x[5]", "x5"),
    ],
)
def test_first_host_of_nodelist(nodelist, first):
    assert discovery.first_host(nodelist) == first


def test_tasks_on_node():
    assert [discovery.tasks_on_node("4(x2),3", node) for node in range(3)] == [4, 4, 3]
    assert discovery.tasks_on_node("2", 0) == 2


@pytest.mark.slow
def test_mpi_rendezvous_on_rank_0s_own_port_or_an_exported_one(tmp_path, corpus):
    """Without MASTER_PORT, rank 0 binds the rendezvous store to a free port itself (no window in
    which another job could take the port); with MASTER_PORT exported, every rank meets there
    instead."""
    for run_name, env in (
        ("own_port", {}),
        ("exported_port", {"MASTER_PORT": str(rendezvous._free_port())}),
    ):
        clean = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
        cmd = [
            mpiexec(),
            "-n",
            "2",
            sys.executable,
            str(ROOT / "basic_training.py"),
            *tiny_args(corpus, run_name, 2),
            "--num_tokens",
            "0",
        ]
        result = subprocess.run(
            cmd,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
            env=dict(clean, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        trained(tmp_path, run_name, steps=2)


def test_ranks_share_the_hosts_cores(monkeypatch):
    """Each of a host's ranks gets an equal share of the cores it may run on (on a GPU host too: a
    thread per core in every rank oversubscribes the cores that launch the kernels);
    OMP_NUM_THREADS, when set, wins."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine
    assert environment.cpu_threads(4, {}) == 16
    assert environment.cpu_threads(1, {}) == 64
    assert environment.cpu_threads(128, {}) == 1
    assert environment.cpu_threads(4, {"OMP_NUM_THREADS": "3"}) == 3
    assert environment.cpu_threads(4, {"OMP_NUM_THREADS": ""}) == 16
    # bound to 8 cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert environment.cpu_threads(2, {}) == 8


def test_a_busy_machine_cuts_the_threads_to_its_idle_cores(monkeypatch):
    """The rest of the machine's load (its 1-minute average) takes cores: a rank gets its share of
    those left idle, at least one; OMP_NUM_THREADS still wins; the reason is said."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert environment.threads_choice(1, {}, load=0.2) == (2, "2 core(s), 1 rank(s) on this host")
    threads, why = environment.threads_choice(1, {}, load=12.5)
    assert threads == 1 and "load 12.5" in why and "idle" in why
    assert environment.threads_choice(1, {}, load=0.9)[0] == 1  # one core busy, one idle
    assert environment.threads_choice(1, {"OMP_NUM_THREADS": "2"}, load=12.5) == (
        2,
        "OMP_NUM_THREADS=2",
    )
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert environment.threads_choice(4, {}, load=8.0)[0] == 14  # (64 - 8) / 4 idle, under 16
    assert environment.threads_choice(4, {}, load=200.0)[0] == 1


def test_device_setup_gives_torch_and_the_compile_workers_the_share(monkeypatch):
    threads = []
    monkeypatch.setattr(environment.torch, "set_num_threads", threads.append)
    monkeypatch.setattr(
        environment, "threads_choice", lambda local_world: (40 // local_world, "a share")
    )
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(environment.torch.cuda, "is_available", lambda: False)
    assert environment._pick_device(0, 4) == (environment.torch.device("cpu"), "gloo")
    assert threads == [10] and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "10"
    assert environment.THREADS["line"] == "10 CPU thread(s) per rank (a share)"  # the banner's
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")  # the user's choice stays
    environment._pick_device(0, 2)
    assert threads == [10, 20] and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "3"


def test_torchrun_variables_inside_an_mpi_launch_are_checked_against_mpi(fake_env):
    """RANK/WORLD_SIZE/MASTER_ADDR beside mpiexec's variables (a PyTorchJob pod's, or exported by a
    script): MPI's own view decides and the variables are checked against it; torchrun's own workers
    carry TORCHELASTIC_RUN_ID."""
    fake_env.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", PMI_RANK="1", PMI_SIZE="2")
    assert discovery.launcher_of(fake_env) == "mpi"
    fake_env.update(TORCHELASTIC_RUN_ID="none")
    assert discovery.launcher_of(fake_env) == "torchrun"


def test_the_launchers_view_must_agree_with_mpis():
    rank_1_of_2_on_one_host = (1, 2, 1, 2, 1)
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert discovery._disagreement(hydra, rank_1_of_2_on_one_host) is None
    # Hydra under srun's PMIx plugin: the srun task's PMIX_RANK is inherited, not a view of
    # this rank.
    assert discovery._disagreement(dict(hydra, PMIX_RANK="0"), rank_1_of_2_on_one_host) is None
    for variables, said in [
        (
            {"OMPI_COMM_WORLD_SIZE": "4"},
            "OMPI_COMM_WORLD_SIZE=4 (Open MPI) but MPI's world size is 2",
        ),
        ({"RANK": "0"}, "RANK=0 (torchrun/PyTorchJob) but MPI's rank is 1"),
        ({"MPI_LOCALNRANKS": "1"}, "MPI_LOCALNRANKS=1 (Hydra) but MPI's ranks on this host is 2"),
        ({"PALS_LOCAL_RANKID": "0"}, "PALS_LOCAL_RANKID=0 (Cray PALS) but MPI's local rank is 1"),
    ]:
        assert said in discovery._disagreement(dict(hydra, **variables), rank_1_of_2_on_one_host)


def test_pmix_and_pals_variables_mpich_cannot_serve_are_refused_before_mpi_init():
    mpich = (
        "MPICH Version:      5.0.2\nMPICH configure:    --with-device=ch4:ucx,ofi "
        "--with-pm=hydra:gforker"
    )
    with pytest.raises(
        ConfigError, match=r"PMIX_RANK=0, PMIX_NAMESPACE=prterun-h-1@1: a PMIx launcher"
    ):
        discovery._refuse_before_init({"PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-h-1@1"}, mpich)
    # Hydra under srun
    discovery._refuse_before_init({"PMIX_RANK": "0", "PMI_RANK": "0", "PMI_SIZE": "2"}, mpich)
    # MPICH with PMIx
    discovery._refuse_before_init({"PMIX_RANK": "0"}, mpich.replace("ofi", "ofi --with-pmix"))
    discovery._refuse_before_init({"PMIX_RANK": "0"}, "Open MPI v5.0.5, package: Open MPI")
    with pytest.raises(ConfigError, match="PALS_RANKID=1 but no PMI_SIZE"):
        discovery._refuse_before_init({"PALS_RANKID": "1", "PALS_LOCAL_RANKID": "1"}, mpich)
    discovery._refuse_before_init({"PALS_RANKID": "1", "PMI_SIZE": "4"}, mpich)


def test_uneven_nodes_are_described_as_they_are():
    """4 ranks laid out 2, 1, 1 used to read '4 rank(s) = 3 node(s) x 2 rank(s)/node'."""

    def env(local_world_sizes, nodes):
        return environment.DistEnv(
            0,
            len(local_world_sizes),
            0,
            local_world_sizes[0],
            nodes,
            None,
            "gloo",
            "mpi",
            local_world_sizes,
        )

    assert env((2, 2, 1, 1), 3).describe() == "4 rank(s) on 3 node(s) of 2, 1, 1 rank(s)"
    assert env((2, 2, 2, 2), 2).describe() == "4 rank(s) = 2 node(s) x 2 rank(s)/node"


def test_a_lost_peers_error_is_cut_between_words(monkeypatch):
    """gloo's long message after a host died mid-save used to end mid-word ('...bugs in t)')."""
    from minimal_fsdp.commands import train as run

    message = (
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.77.0.2]:4242 "
        + "word " * 60
    )
    said = []
    monkeypatch.setattr(run.run, "run", lambda cfg: (_ for _ in ()).throw(RuntimeError(message)))
    monkeypatch.setattr(
        run.failures, "exit_on_error", lambda error, code: said.append((error, code))
    )
    run.main(object())
    ((error, code),) = said
    assert code == 1 and error.endswith("word ...)") and "Connection closed by peer" in error


def raised(error, during):
    """`error` as Python raises it while handling `during` (its __context__ set)."""
    try:
        try:
            raise during
        except BaseException:
            raise error
    except BaseException as e:
        return e


def test_a_peer_lost_during_a_save_is_one_line(monkeypatch):
    """A rank stopped while the others save: DCP's gather timed out, then the save's own
    all_gather_object found gloo's pair closed. This used to end in a 60-line traceback with no
    `error:` line ("Application timeout caused pair closure" was no peer-gone text); the line names
    the first failure."""
    from torch.distributed.checkpoint import CheckpointException

    from minimal_fsdp.commands import train as run

    timed_out = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed "
        "out waiting 10000ms for send operation to complete"
    )
    closed = raised(RuntimeError("Application timeout caused pair closure"), during=timed_out)
    reset = RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection reset by peer [::1]:2")
    inside_dcp = CheckpointException("gather failed", {1: (reset, None)})
    said = []
    monkeypatch.setattr(
        run.failures, "exit_on_error", lambda error, code: said.append((error, code))
    )
    for error in (closed, inside_dcp, raised(RuntimeError("pair closure"), during=inside_dcp)):
        monkeypatch.setattr(run.run, "run", lambda cfg, error=error: (_ for _ in ()).throw(error))
        run.main(object())
    assert said == [
        (
            "a collective waited longer than --collective_timeout: another rank or its host has "
            "died, hangs or cannot be reached (Timed out waiting 10000ms for send operation to "
            "complete)",
            1,
        ),
        (
            "a collective failed: another rank or its host has died, hangs or cannot be reached "
            "(Connection reset by peer [::1]:2)",
            1,
        ),
        (
            "a collective failed: another rank or its host has died, hangs or cannot be reached "
            "(Connection reset by peer [::1]:2)",
            1,
        ),
    ]
    # what the train command picks its line by: the first failure's words and whether it timed out
    lost_peer = run.failures.lost_peer
    assert lost_peer(closed) == (
        "Timed out waiting 10000ms for send operation to complete",
        True,
    )
    assert lost_peer(inside_dcp) == ("Connection reset by peer [::1]:2", False)
    # any other RuntimeError is a bug: its traceback stays
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert lost_peer(bug) is None
    monkeypatch.setattr(run.run, "run", lambda cfg: (_ for _ in ()).throw(bug))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run.main(object())


@pytest.mark.slow
def test_torchrun_waiting_for_a_node_that_never_starts_is_bounded_by_the_documented_flag(tmp_path):
    """`torchrun --nnodes 2` without the second node waits silently (600 s by default, torchrun's
    own); the flag docs/launch.md names bounds it."""
    flag = re.search(r"`(--rdzv_conf timeout=)SECONDS`", (ROOT / "docs" / "launch.md").read_text())
    assert flag, "docs/launch.md names the flag that bounds torchrun's wait for the other nodes"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [
        torchrun,
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--node_rank",
        "0",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(rendezvous._free_port()),
        *f"{flag[1]}5".split(),
        ROOT / "basic_training.py",
    ]
    result = subprocess.run(
        list(map(str, cmd)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        # the timeout: a bound on a hang only
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode != 0 and "1/2 clients joined" in result.stderr, result.stderr[-2000:]


# --- every launcher value in range, before the first collective ---

TORCHRUN_WORKER = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}


@pytest.mark.parametrize(
    "changed,said",
    [
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 (torchrun): a job has at least one rank"),
        ({"RANK": "-1"}, "RANK=-1 but WORLD_SIZE=2 (torchrun): a rank runs from 0 to 1"),
        ({"RANK": "2"}, "RANK=2 but WORLD_SIZE=2 (torchrun): a rank runs from 0 to 1"),
        ({"LOCAL_RANK": "3"}, "LOCAL_RANK=3 but LOCAL_WORLD_SIZE=2 (torchrun)"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 but LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 (torchrun): 4 rank(s) on this node, but"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 (torchrun): 0 rank(s) on this node"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 (torchrun) is not a port (1 to 65535)"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT=0 (torchrun) is not a port"),
        ({"MASTER_PORT": None}, "MASTER_ADDR is set (torchrun) but not MASTER_PORT"),
    ],
)
def test_torchrun_values_out_of_range_are_one_line(fake_env, changed, said):
    """WORLD_SIZE=0 used to divide by zero in discovery, MASTER_PORT=70000 to trace back in c10d,
    RANK=2 of 2 to end in a gloo enforce while the other rank waited."""
    fake_env.update(TORCHRUN_WORKER)
    assert discovered() == (1, 2, 1, 2, 1, "torchrun")
    for name, value in changed.items():
        if value is None:
            del fake_env[name]
        else:
            fake_env[name] = value
    with pytest.raises(ConfigError) as refused:
        discovered()
    assert said in str(refused.value)


def test_a_world_of_one_with_another_rank_than_0_is_refused(fake_env):
    """RANK=1 WORLD_SIZE=1 printed nothing for minutes: a world of one skips the rendezvous deadline
    and has no rank 0."""
    fake_env.update(RANK="1", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    with pytest.raises(ConfigError, match=r"RANK=1 but WORLD_SIZE=1 \(set without torchrun\)"):
        discovered()
    fake_env.update(RANK="0")  # a world of one set by hand is fine: no local variables needed
    assert discovered() == (0, 1, 0, 1, 1, "torchrun")


def test_a_pod_with_a_rank_past_the_world_is_refused_up_front(fake_env):
    fake_env.update(
        RANK="2", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="23456", PET_NNODES="2"
    )
    with pytest.raises(ConfigError, match=r"RANK=2 but WORLD_SIZE=2 \(a PyTorchJob\)"):
        discovered()


def test_a_world_set_by_hand_without_local_variables_is_refused(fake_env):
    """RANK/WORLD_SIZE/MASTER_ADDR exported by hand made both ranks local rank 0 of one node of 2,
    against docs/launch.md's "never from WORLD_SIZE alone"."""
    fake_env.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="23456")
    with pytest.raises(
        ConfigError,
        match=r"RANK=1, WORLD_SIZE=2 and MASTER_ADDR \(set without torchrun\) but no "
        "LOCAL_WORLD_SIZE: .* \\(never guessed from WORLD_SIZE alone\\)",
    ):
        discovered()
    fake_env.update(LOCAL_WORLD_SIZE="2")  # the ranks per node, but no local rank
    with pytest.raises(ConfigError, match="but no LOCAL_RANK, with LOCAL_WORLD_SIZE=2"):
        discovered()
    fake_env.update(LOCAL_RANK="1")
    assert discovered() == (1, 2, 1, 2, 1, "torchrun")
    # one node of 2 from the pod count, but no local rank: refused alike
    del fake_env["LOCAL_WORLD_SIZE"], fake_env["LOCAL_RANK"]
    fake_env.update(PET_NNODES="1")
    with pytest.raises(ConfigError, match="but no LOCAL_RANK, with WORLD_SIZE=2 over PET_NNODES=1"):
        discovered()


@pytest.mark.parametrize(
    "changed,said",
    [
        ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS=0 (srun): a job has at least one"),
        ({"SLURM_PROCID": "7"}, "SLURM_PROCID=7 but SLURM_STEP_NUM_TASKS=7 (srun)"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID=-1 but SLURM_STEP_NUM_TASKS=7"),
        # a lone rank on node 2 with no node id used to say it shared node 0 with 3 others
        ({"SLURM_NODEID": None}, "SLURM_NODEID is not set in a step over 2 nodes"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 but the step runs on 2 node(s)"),
        ({"SLURM_LOCALID": "3"}, "SLURM_LOCALID=3 but SLURM_STEP_TASKS_PER_NODE=4,3 at"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "4(x2)"},
            "SLURM_STEP_TASKS_PER_NODE=4(x2) (srun) is 8 task(s) on 2 node(s), but "
            "SLURM_STEP_NUM_TASKS=7 over 2 node(s)",
        ),
        ({"SLURM_STEP_NUM_NODES": "3"}, "is 7 task(s) on 2 node(s), but SLURM_STEP_NUM_TASKS=7 "),
        ({"SLURM_STEP_TASKS_PER_NODE": "4,x"}, "SLURM_STEP_TASKS_PER_NODE='4,x' is not a list"),
        ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536 (srun) is not a port"),
    ],
)
def test_srun_variables_that_disagree_are_one_line(fake_env, changed, said):
    fake_env.update(SLURM_TASK)
    for name, value in changed.items():
        if value is None:
            del fake_env[name]
        else:
            fake_env[name] = value
    with pytest.raises(ConfigError) as refused:
        discovered()
    assert said in str(refused.value)


def test_a_two_task_step_that_says_four_tasks_on_its_node_is_refused(fake_env):
    fake_env.update(
        SLURM_TASK,
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_NODEID="0",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_TASKS_PER_NODE="4",
    )
    with pytest.raises(ConfigError, match=r"=4 \(srun\) is 4 task\(s\) on 1 node\(s\), but"):
        discovered()
    fake_env.update(SLURM_STEP_TASKS_PER_NODE="2")
    assert discovered() == (1, 2, 1, 2, 1, "srun")


def test_master_port_out_of_range_under_mpi_is_said_by_every_rank_alike(fake_env, monkeypatch):
    """Checked after MPI_Init, with the launcher's views, so that the ranks agree on one line."""
    fake_env.update(MASTER_PORT="70000")
    with pytest.raises(ConfigError, match=r"MASTER_PORT=70000 \(exported to mpiexec\) is not a"):
        discovery.check_master_port(fake_env, "exported to mpiexec")
    discovery.check_master_port({}, "exported to mpiexec")  # unset: rank 0 picks a free port


def test_two_ranks_of_one_node_never_share_a_local_rank():
    """Every rank's (host, node id, local rank, ranks on its node), gathered at the first
    collective."""
    clash = environment.hosts.local_rank_clash
    good = [(7, 0, 0, 2), (7, 0, 1, 2), (7, 1, 0, 1)]  # srun's 2,1 on pretend nodes of one host
    assert clash(good, "SLURM_LOCALID") is None
    said = clash([(7, -1, 0, 2), (7, -1, 0, 2)], "LOCAL_RANK")
    assert said.startswith("ranks 0 and 1 both have LOCAL_RANK=0 on one node")
    # two hosts, each rank saying its node runs 2
    said = clash([(7, -1, 0, 2), (8, -1, 1, 2)], "LOCAL_RANK")
    assert said.startswith("rank 0 says its node runs 2 rank(s), but 1 run there (ranks 0)")
    assert discovery.node_of("srun", {"SLURM_NODEID": "1"}) == (1, "SLURM_LOCALID")
    assert discovery.node_of("torchrun", {"GROUP_RANK": "3"}) == (3, "LOCAL_RANK")
    assert discovery.node_of("torchrun", {}) == (-1, "LOCAL_RANK")
    assert discovery.node_of("mpi", {}) is None  # MPI's own split by host: distinct by design
