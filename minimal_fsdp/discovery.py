"""Who am I and how many are we: rank, world size, local rank, ranks per host and hosts, from the launcher's
variables (torchrun, srun, PBS's node file) or from MPI itself; where two sources disagree, one line.

Detection order: torchrun's variables, then MPI's, then srun's. MPI comes before srun because an mpiexec
started inside a SLURM job inherits SLURM_* variables that describe the job (or Hydra's per-node proxies),
not the MPI ranks; only PMIx variables that srun's own plugin set (its namespace names the step) mean srun.
"""
import os
import re

from . import failures
from .config import ConfigError

# Variables that MPI launchers set in every rank: MPICH/Hydra, Open MPI, PMIx, Cray PALS.
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "PMI_SIZE")
# Where a launcher says how many ranks it started (PMIx has no such variable).
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def int_variable(env, name, default=None):
    """An integer launcher variable; a malformed one (e.g. a literal '$(PET_NNODES)') is a one-line error."""
    value = env.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a number: check the launcher that set it") from None


# --- PBS ---

def count_pbs_nodes(nodefile):
    """Distinct hosts in a PBS nodefile, counted as pbs/common.sh counts them: blank lines skipped, case
    ignored, and a fully qualified name taken as its short name (x1.hsn.example.org and x1 are one node)."""
    hosts = set()
    with open(nodefile) as f:
        for line in f:
            host = (line.split() or [""])[0].lower()
            if not re.fullmatch(r"[\d.]*", host):  # an IPv4 address stays whole
                host = host.split(".")[0]
            if host:
                hosts.add(host)
    return len(hosts)


def pbs_layout(world):
    """(nodes, ranks per node) from PBS_NODEFILE; every rank reads the same file, so all agree."""
    nodefile = os.environ.get("PBS_NODEFILE")
    if not nodefile:
        raise ConfigError("--environment pbs needs PBS_NODEFILE (run inside a PBS job, or use --environment auto)")
    try:
        nodes = count_pbs_nodes(nodefile)
    except OSError as e:
        raise ConfigError(f"--environment pbs: cannot read PBS_NODEFILE={nodefile}: {e.strerror or e} (run inside "
                          "the PBS job that wrote it, or use --environment auto)") from None
    if not nodes or world % nodes:
        raise ConfigError(f"--environment pbs: {world} rank(s) cannot be spread evenly over the {nodes} node(s) of "
                          "PBS_NODEFILE: start the same number of ranks on every node (mpiexec -n NODES*K --ppn K)")
    return nodes, world // nodes


# --- the launcher ---

def launcher_of(env):
    """Which launcher started this process: 'torchrun', 'srun', 'mpi' or 'single'. Reads variables only."""
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:  # torchrun, Kubernetes PyTorchJob
        return "torchrun"
    if _srun_pmix(env):
        return "srun"
    if any(v in env for v in MPI_RANK_VARIABLES):
        return "mpi"
    # srun sets SLURM_STEP_NUM_TASKS for the tasks it starts; a batch script also has SLURM_PROCID=0 and
    # SLURM_NTASKS, but is one process, so without the step variables it is a single rank.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return "srun"
    return "single"


def discover(launcher, env):
    """(rank, world, local_rank, local_world, num_nodes) as `launcher` tells them."""
    if launcher == "torchrun":
        return _discover_torchrun(env)
    if launcher == "srun":
        return _discover_srun(env)
    if launcher == "mpi":
        return _discover_mpi(env)
    return 0, 1, 0, 1, 1


def _srun_pmix(env):
    """srun started this process through its PMIx plugin (`srun` without --mpi=none on a PMIx cluster): the
    PMIx namespace names this job step, and no mpiexec variables are set. Every task sees the same answer.
    srun's variables then give the layout, and MPI is never initialized (an mpi4py built against another
    MPI would abort in MPI_Init, or see a world of one)."""
    step = f"slurm.pmix.{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}"
    mpiexec_variables = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PALS_RANKID")
    return (env.get("PMIX_NAMESPACE") == step and "SLURM_STEP_NUM_TASKS" in env
            and not any(name in env for name in mpiexec_variables))


def _discover_torchrun(env):
    # A Kubeflow PyTorchJob sets RANK and WORLD_SIZE per pod, for torchrun to split among its processes;
    # read by a process that torchrun did not start (no LOCAL_RANK), they describe the wrong world.
    if "LOCAL_RANK" not in env and env.get("PET_NPROC_PER_NODE", "1") != "1":
        raise ConfigError(f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are the PyTorchJob pod's, for "
                          f"torchrun to split among PET_NPROC_PER_NODE={env['PET_NPROC_PER_NODE']} processes: "
                          "start basic_training.py with torchrun (see k8s/pytorchjob.yaml)")
    world = int_variable(env, "WORLD_SIZE")
    local_world = int_variable(env, "LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    return int_variable(env, "RANK"), world, int_variable(env, "LOCAL_RANK", "0"), local_world, max(1, world // local_world)


def _discover_srun(env):
    """Rank and layout from srun's task variables."""
    world = int_variable(env, "SLURM_STEP_NUM_TASKS")
    num_nodes = int_variable(env, "SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))
    # SLURM_STEP_TASKS_PER_NODE is the step's; SLURM_TASKS_PER_NODE, the job's, is the same for the usual
    # one step over the whole allocation.
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
    local_world = tasks_on_node(per_node, int_variable(env, "SLURM_NODEID", "0"))
    return int_variable(env, "SLURM_PROCID"), world, int_variable(env, "SLURM_LOCALID", "0"), local_world, num_nodes


# --- MPI ---

def _launcher_world_size(env):
    """How many ranks an MPI launcher says it started, from its own variables (at least rank + 1)."""
    for name in MPI_SIZE_VARIABLES:
        if name in env:
            return int_variable(env, name)
    ranks = [int_variable(env, name) for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID")
             if name in env]
    return max(ranks) + 1 if ranks else 1


def _check_not_alone(world, env):
    """mpi4py built against another MPI than the launcher's does not fail: each process initializes a world
    of its own and trains alone. The launcher's variables tell."""
    expected = _launcher_world_size(env)
    if world.Get_size() == 1 and expected > 1:
        from mpi4py import MPI
        library = " ".join(MPI.Get_library_version().split("\n")[0].split())  # e.g. 'MPICH Version: 5.0.2'
        raise ConfigError(f"the launcher started {expected} ranks but mpi4py's MPI ({library}) sees a world of 1: "
                          "mpi4py is built against a different MPI than the launcher's. Use an mpi4py built for "
                          "the site MPI (e.g. MPICC=cc pip install --no-binary mpi4py mpi4py), or under srun add "
                          "--mpi=none; see docs/launch.md")


def _discover_mpi(env):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    failures.agree_through(world.Dup())  # first: nothing below may leave another rank waiting
    _check_not_alone(world, env)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    num_nodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
    return world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size(), num_nodes


# --- SLURM's compressed lists ---

def first_host(nodelist):
    """The first host of a SLURM nodelist: 'gpu[07-09,12],cpu1' -> 'gpu07', 'r[1-2]-n[3-4]' -> 'r1-n3'."""
    first, depth = "", 0
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    # Each bracketed range list contributes its first value, zero padding kept.
    return re.sub(r"\[([^],-]+)[^]]*\]", r"\1", first)


def tasks_on_node(tasks_per_node, node_id):
    """SLURM's compressed per-node task counts, '4(x2),3' = 4,4,3, read at this node's index."""
    counts = []
    for item in tasks_per_node.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts[min(node_id, len(counts) - 1)]
