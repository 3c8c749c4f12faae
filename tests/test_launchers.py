"""Every launcher script, run for real on CPU: the PBS job scripts under a faked PBS job (this host in
PBS_NODEFILE, the mpich wheel's mpiexec), the sbatch script with a stand-in srun, and the Kubernetes
manifest's torchrun command. Plus srun detection from faked SLURM variables."""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL, mpiexec
from minimal_fsdp import environment


def tiny_args(corpus, run_name, steps=3, tensorboard=False):
    return ["--dataset", "text", "--input_file", str(corpus), *TINY_MODEL, "--max_steps", str(steps),
            "--eval_interval", "0", "--log_interval", "1", "--run_name", run_name,
            "--tensorboard" if tensorboard else "--no-tensorboard"]


def run_script(cmd, tmp_path, env, timeout=240):
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHON=sys.executable, **env)
    result = subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def trained(tmp_path, run_name, steps=3):
    """The run left a complete checkpoint and one metrics row per step."""
    assert (tmp_path / "checkpoints" / run_name / "latest").read_text().strip() == f"step_{steps}"
    rows = [json.loads(line) for line in (tmp_path / "logs" / run_name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))


def pbs_job(tmp_path, script, nodes, ranks_per_node, args):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{host}\n" for host in nodes for _ in range(ranks_per_node)))
    env = {"PBS_NODEFILE": str(nodefile), "PBS_JOBID": "1234.test", "PBS_O_WORKDIR": str(tmp_path),
           "REPO": str(ROOT), "MPIEXEC": mpiexec(), "NRANKS_PER_NODE": str(ranks_per_node), "NDEPTH": "1",
           "CPU_BIND": "", "ARGS": " ".join(args)}  # Hydra's mpiexec knows --ppn but not Cray's --depth
    return run_script(["bash", str(ROOT / "pbs" / script)], tmp_path, env)


def test_pbs_scripts_train_and_generate(tmp_path, corpus):
    out = pbs_job(tmp_path, "train_single_node.sh", [socket.gethostname()], 2, tiny_args(corpus, "single"))
    assert "1 node(s) x 2 rank(s) = 2 rank(s)" in out.stdout and "mesh shard=2 (full-shard)" in out.stdout
    trained(tmp_path, "single")
    # Two "nodes" that are both this machine: Hydra starts one proxy per PBS_NODEFILE host. One rank per
    # node keeps the test cheap; test_end_to_end runs the 2 x 2 hybrid mesh.
    out = pbs_job(tmp_path, "train_multi_node.sh", ["localhost", socket.gethostname()], 1,
                  tiny_args(corpus, "multi"))
    assert "2 node(s) x 1 rank(s)/node" in out.stdout
    assert "mesh replicate=2 x shard=1 (hybrid-full-shard)" in out.stdout
    trained(tmp_path, "multi")
    out = pbs_job(tmp_path, "generate.sh", [socket.gethostname()], 1,
                  ["--run_name", "multi", "--prompt", "KING:", "--num_tokens", "25"])
    assert "generating from checkpoints/multi/step_3" in out.stdout
    sample = out.stdout.split("-" * 40 + "\n")[1]
    assert sample.startswith("KING:") and len(sample.rstrip("\n")) == len("KING:") + 25
    assert (tmp_path / "checkpoints" / "multi" / "latest").read_text().strip() == "step_3"  # nothing trained


FAKE_SRUN = """#!{python}
# Stands in for srun: starts SLURM_NTASKS copies of the command on this host with srun's task variables.
import os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["SRUN_FLAGS_FILE"], "w") as f:
    f.write(" ".join(a for a in args if a.startswith("--")))
while args[0].startswith("-"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_NODEID="0",
                                         SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_NUM_NODES="1",
                                         SLURM_STEP_TASKS_PER_NODE=str(n),
                                         SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"]))
         for i in range(n)]
sys.exit(max(t.wait() for t in tasks))
"""


def test_sbatch_script_trains_under_srun(tmp_path, corpus):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    # What sbatch gives the batch script: note SLURM_PROCID=0 and SLURM_NTASKS=2 in this one process.
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": socket.gethostname(),
           "SLURM_SUBMIT_DIR": str(tmp_path), "ENTRY": str(ROOT / "basic_training.py"),
           "SRUN_FLAGS_FILE": str(tmp_path / "srun_flags")}
    out = run_script(["bash", str(ROOT / "slurm" / "train.sbatch"), *tiny_args(corpus, "slurm")], tmp_path, env)
    assert "launch: 2 rank(s) = 1 node(s) x 2 rank(s)/node, started by srun" in out.stdout
    assert "--mpi=none" in (tmp_path / "srun_flags").read_text()
    trained(tmp_path, "slurm")


def envsubst(text, values):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], ""), text)


def test_kubernetes_manifest_runs_torchrun(tmp_path, corpus):
    yaml = pytest.importorskip("yaml")
    template = (ROOT / "k8s" / "pytorchjob.yaml").read_text()
    values = {"JOB_NAME": "tiny", "IMAGE_URI": "minimal_fsdp:test", "NUM_WORKERS": "0", "GPU_PER_NODE": "2",
              "INSTANCE_TYPE": "cpu", "SHARED_PVC": "claim", "SHARED_DIR": str(tmp_path),
              "TRAINING_ARGS": " ".join(tiny_args(corpus, "k8s", tensorboard=True))}
    assert set(re.findall(r"\$\{(\w+)\}", template)) == set(values)  # every placeholder is one we document
    for name in values:
        assert f"export {name}=" in template or f" {name}=" in template, name
    job = yaml.safe_load(envsubst(template, values))
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 0
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == 2
    # What the training operator and kubelet do in the pod: fill in $(NAME) from the pod's variables.
    pod_env = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"], "PET_NODE_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(environment._free_port())}
    command = re.sub(r"\$\((\w+)\)", lambda m: pod_env[m[1]], container["args"][0])
    assert command.startswith("torchrun ") and "--nproc_per_node=2" in command
    torchrun_dir = Path(sys.executable).parent  # the torchrun beside this Python
    out = run_script([*container["command"], command], ROOT, {"PATH": f"{torchrun_dir}:{os.environ['PATH']}"})
    assert "launch: 2 rank(s) = 1 node(s) x 2 rank(s)/node, started by torchrun" in out.stdout
    trained(tmp_path, "k8s")
    assert len(list((tmp_path / "logs" / "k8s").glob("events.out.tfevents.*"))) == 1  # rank 0 only


# srun detection from the environment alone (no real SLURM here).
SLURM_TASK = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "7",
              "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,3", "SLURM_JOB_ID": "77",
              "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "7"}
LAUNCH_VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    *environment.MPI_RANK_VARIABLES, *SLURM_TASK]


@pytest.fixture
def fake_env(monkeypatch):
    """os.environ without any launcher's variables; what _discover writes (MASTER_ADDR) stays in the test."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_srun_task_variables(fake_env):
    fake_env.update(SLURM_TASK)
    assert environment._discover("auto") == (5, 7, 1, 3, 2, "srun")
    assert fake_env["MASTER_ADDR"] == "gpu07"
    port = fake_env.pop("MASTER_PORT")
    environment._discover("auto")
    assert fake_env["MASTER_PORT"] == port  # every task derives the same port, without talking


def test_exported_master_addr_wins_under_srun(fake_env):
    fake_env.update(SLURM_TASK, MASTER_ADDR="10.0.0.1")
    environment._discover("auto")
    assert fake_env["MASTER_ADDR"] == "10.0.0.1"


def test_srun_on_one_node_rendezvous_locally(fake_env):
    fake_env.update(SLURM_TASK, SLURM_STEP_NUM_NODES="1", SLURM_STEP_TASKS_PER_NODE="7", SLURM_NODEID="0")
    assert environment._discover("auto") == (5, 7, 1, 7, 1, "srun")
    assert fake_env["MASTER_ADDR"] == "127.0.0.1"


def test_batch_script_alone_is_one_rank(fake_env):
    """A batch script has SLURM_PROCID=0 and SLURM_NTASKS but is one process: no step variables, no srun."""
    fake_env.update(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_JOB_ID="77")
    assert environment._discover("auto")[:2] == (0, 1)


def test_mpi_wins_over_slurm_variables(fake_env, monkeypatch):
    """mpiexec inside a SLURM job: the ranks inherit SLURM_* of the job, but MPI knows the real layout."""
    fake_env.update(SLURM_TASK, PMI_RANK="3")
    monkeypatch.setattr(environment, "_discover_mpi", lambda: (3, 4, 3, 4, 1))
    assert environment._discover("auto") == (3, 4, 3, 4, 1, "mpi")


@pytest.mark.parametrize("nodelist,first", [
    ("node17", "node17"), ("gpu[07-09,12],cpu1", "gpu07"), ("nid[001234,002000-002010]", "nid001234"),
    ("rack[1-2]-n[3-4]", "rack1-n3"), ("a-1,b-2", "a-1"), ("x[5]", "x5")])
def test_first_host_of_nodelist(nodelist, first):
    assert environment.first_host(nodelist) == first


def test_tasks_on_node():
    assert [environment.tasks_on_node("4(x2),3", node) for node in range(3)] == [4, 4, 3]
    assert environment.tasks_on_node("2", 0) == 2


def test_mpi_rendezvous_on_rank_0s_own_port_or_an_exported_one(tmp_path, corpus):
    """Without MASTER_PORT, rank 0 binds the rendezvous store to a free port itself (no window in which another
    job could take the port); with MASTER_PORT exported, every rank meets there instead."""
    for run_name, env in (("own_port", {}), ("exported_port", {"MASTER_PORT": str(environment._free_port())})):
        clean = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
        cmd = [mpiexec(), "-n", "2", sys.executable, str(ROOT / "basic_training.py"), *tiny_args(corpus, run_name, 2),
               "--num_tokens", "0"]
        result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                                env=dict(clean, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env))
        assert result.returncode == 0, result.stderr[-3000:]
        trained(tmp_path, run_name, steps=2)
