"""Who am I and how many are we: rank, world size, local rank, ranks per host and hosts, from the
launcher's variables (torchrun, srun, PBS's node file) or from MPI itself; where two sources
disagree, one line.

Detection order: torchrun's variables, then MPI's, then srun's. MPI comes before srun because an
mpiexec started inside a SLURM job inherits SLURM_* variables that describe the job (or Hydra's
per-node proxies), not the MPI ranks; only PMIx variables that srun's own plugin set (its namespace
names the step) mean srun.
"""

import errno
import os
import re
import socket
import stat

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.files import read_text
from minimal_fsdp.launch import failures

MAX_WORLD = 2**24  # ranks: config/checks.py's cap on a checkpoint's world_size
# Variables that MPI launchers set in every rank: MPICH/Hydra, Open MPI, PMIx, Cray PALS.
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "PMI_SIZE")
# Where a launcher says how many ranks it started (PMIx has no such variable).
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def int_variable(env, name, default=None):
    """An integer launcher variable; a malformed one (e.g. a literal '$(PET_NNODES)') is a one-line
    error."""
    value = env.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}={value!r} is not a number: check the launcher that set it"
        ) from None


# --- PBS ---


def count_pbs_nodes(nodefile):
    """Distinct hosts in a PBS nodefile, counted as pbs/common.sh counts them: blank lines skipped,
    case ignored, and a fully qualified name taken as its short name (x1.hsn.example.org and x1 are
    one node)."""
    hosts = set()
    # a regular file (a FIFO would block) of at most 64 MiB: a line per rank of the job
    try:
        text = read_text(nodefile, 64 * 2**20, follow_links=True)
    except ValueError as e:
        raise OSError(errno.EINVAL, str(e), nodefile) from None
    for line in text.splitlines():
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
        raise ConfigError(
            "--environment pbs needs PBS_NODEFILE (run inside a PBS job, or use --environment auto)"
        )
    try:
        nodes = count_pbs_nodes(nodefile)
    except OSError as e:
        raise ConfigError(
            f"--environment pbs: cannot read PBS_NODEFILE={nodefile}: {e.strerror or e} (run "
            "inside the PBS job that wrote it, or use --environment auto)"
        ) from None
    if not nodes or world % nodes:
        raise ConfigError(
            f"--environment pbs: {world} rank(s) cannot be spread evenly over the {nodes} node(s) "
            "of PBS_NODEFILE: start the same number of ranks on every node (mpiexec -n NODES*K "
            "--ppn K)"
        )
    return nodes, world // nodes


# --- the launcher ---


def launcher_of(env):
    """Which launcher started this process: 'torchrun', 'srun', 'mpi' or 'single'. Reads variables
    only."""
    mpi = any(v in env for v in MPI_RANK_VARIABLES)
    # torchrun, Kubernetes PyTorchJob
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        # Inside an mpiexec launch (a PyTorchJob pod's variables, or a script that exports RANK)
        # MPI's own view wins and RANK/WORLD_SIZE are checked against it; torchrun's workers
        # carry TORCHELASTIC_RUN_ID.
        if not mpi or "TORCHELASTIC_RUN_ID" in env:
            return "torchrun"
    if _srun_pmix(env):
        return "srun"
    if mpi:
        return "mpi"
    # srun sets SLURM_STEP_NUM_TASKS for the tasks it starts; a batch script also has SLURM_PROCID=0
    # and SLURM_NTASKS, but is one process, so without the step variables it is a single rank.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return "srun"
    return "single"


def discover(launcher, env, pbs=False, timeout=300):
    """(rank, world, local_rank, local_world, num_nodes) as `launcher` tells them; pbs: the nodes
    and ranks per node from PBS_NODEFILE (--environment pbs). timeout: how long MPI's own discovery
    may wait for a rank."""
    if launcher == "mpi":
        return _discover_mpi(env, pbs, timeout)
    if launcher == "torchrun":
        found = _discover_torchrun(env)
    elif launcher == "srun":
        found = _discover_srun(env)
    else:
        if env.get("SLURM_PROCID", "0") != "0" and "SLURM_STEP_NUM_TASKS" not in env:
            raise ConfigError(
                f"SLURM_PROCID={env['SLURM_PROCID']} without srun's step variables "
                "(SLURM_STEP_NUM_TASKS): this process is one of several that did not come from "
                "srun, and each would train alone; start them with srun (or mpiexec)"
            )
        found = 0, 1, 0, 1, 1
    if pbs:
        found = (*found[:3], *reversed(pbs_layout(found[1])))
    return _checked_layout(launcher, found)


def _checked_layout(launcher, found):
    """(rank, world, local_rank, local_world, num_nodes) that describe a world: ConfigError naming
    the launcher's variables otherwise (a negative or zero size, a rank past the world)."""
    rank, world, local_rank, local_world, nodes = found
    if not (
        1 <= world <= MAX_WORLD
        and 0 <= rank < world
        and 1 <= local_world <= world
        and 0 <= local_rank < local_world
        and 1 <= nodes <= world
    ):
        raise ConfigError(
            f"the {launcher} launcher's variables describe no world: rank {rank} of {world}, "
            f"local rank {local_rank} of {local_world}, {nodes} node(s) (the world at most "
            f"{MAX_WORLD}): check the launcher that set them"
        )
    return found


def _srun_pmix(env):
    """srun started this process through its PMIx plugin (`srun` without --mpi=none on a PMIx
    cluster): the PMIx namespace names this job step, and no mpiexec variables are set. Every task
    sees the same answer. srun's variables then give the layout, and MPI is never initialized (an
    mpi4py built against another MPI would abort in MPI_Init, or see a world of one)."""
    step = f"slurm.pmix.{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}"
    mpiexec_variables = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PALS_RANKID")
    return (
        env.get("PMIX_NAMESPACE") == step
        and "SLURM_STEP_NUM_TASKS" in env
        and not any(name in env for name in mpiexec_variables)
    )


def _discover_torchrun(env):
    # A Kubeflow PyTorchJob sets RANK and WORLD_SIZE per pod, for torchrun to split among its
    # processes; read by a process that torchrun did not start (no LOCAL_RANK), they describe the
    # wrong world.
    if "LOCAL_RANK" not in env and env.get("PET_NPROC_PER_NODE", "1") != "1":
        raise ConfigError(
            f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are the PyTorchJob pod's, for "
            f"torchrun to split among PET_NPROC_PER_NODE={env['PET_NPROC_PER_NODE']} processes: "
            "start basic_training.py with torchrun (see k8s/pytorchjob.yaml)"
        )
    who = _torchrun_who(env)
    world, rank = int_variable(env, "WORLD_SIZE"), int_variable(env, "RANK")
    check_ranks(("RANK", rank), ("WORLD_SIZE", world), who)
    local_world, local_world_name = _torchrun_local_world(env, world, who)
    if "LOCAL_RANK" not in env and local_world > 1:
        raise ConfigError(
            f"RANK={rank} and WORLD_SIZE={world} ({who}) but no LOCAL_RANK, with "
            f"{local_world_name}: the ranks of a node would all take local rank 0 (one GPU); start "
            "with torchrun, or export LOCAL_RANK too"
        )
    local_rank = int_variable(env, "LOCAL_RANK", "0")
    check_local(("LOCAL_RANK", local_rank), local_world_name, local_world, world, who)
    if world > 1:
        check_master_port(env, who, required=True)
        try:  # torch would retry an unknown name until its timeout, then end in tracebacks
            socket.getaddrinfo(env["MASTER_ADDR"], None)
        except (socket.gaierror, UnicodeError):
            raise ConfigError(
                f"MASTER_ADDR {env['MASTER_ADDR']} does not resolve on {socket.gethostname()}: set "
                "it to an address of rank 0's node that every node can reach"
            ) from None
    return rank, world, local_rank, local_world, max(1, world // local_world)


def _torchrun_who(env):
    """Who set RANK/WORLD_SIZE/MASTER_ADDR, for the error lines."""
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if any(name.startswith("PET_") for name in env):
        return "a PyTorchJob"
    return "set without torchrun"


def _torchrun_local_world(env, world, who):
    """(ranks on this node, the text that says where that number came from): LOCAL_WORLD_SIZE
    (torchrun's); without it, a PyTorchJob pod's PET_NPROC_PER_NODE, or the world over PET_NNODES;
    never the whole world, which would put every pod on one node (one process per pod would count
    as one node of WORLD_SIZE ranks, and hybrid sharding would shard across the pods). A world of
    more than one rank with none of them is refused: the ranks per node are unknown."""
    if "LOCAL_WORLD_SIZE" in env:
        local_world = int_variable(env, "LOCAL_WORLD_SIZE")
        return local_world, f"LOCAL_WORLD_SIZE={local_world}"
    if env.get("PET_NPROC_PER_NODE", "").isdigit():
        local_world = int_variable(env, "PET_NPROC_PER_NODE")
        return local_world, f"PET_NPROC_PER_NODE={local_world}"
    if "PET_NNODES" in env:
        nodes = int_variable(env, "PET_NNODES")
        if nodes > 0 and world % nodes == 0:
            return world // nodes, f"WORLD_SIZE={world} over PET_NNODES={nodes}"
    if world == 1:
        return 1, "WORLD_SIZE=1"
    raise ConfigError(
        f"RANK={env['RANK']}, WORLD_SIZE={world} and MASTER_ADDR ({who}) but no LOCAL_WORLD_SIZE: "
        "how many ranks share this node is unknown (never guessed from WORLD_SIZE alone); start "
        "with torchrun, or export LOCAL_RANK and LOCAL_WORLD_SIZE too (or use mpiexec, which finds "
        "them itself)"
    )


# --- one node's ranks, seen together ---

# What names a node besides its hostname, and which variable holds the local rank, per launcher:
# two ranks of one node must not claim the same local rank (launch.hosts.local_rank_clash). MPI is
# not listed: its local ranks come from its own split by host, distinct by construction.
NODE_VARIABLES = {
    "srun": (("SLURM_NODEID",), "SLURM_LOCALID"),
    "torchrun": (("GROUP_RANK", "PET_NODE_RANK"), "LOCAL_RANK"),
}


def node_of(launcher, env):
    """(the launcher's id of this node, or -1 where it sets none; the local rank's variable), or
    None where the launcher's own layout needs no check (MPI, a single process)."""
    if launcher not in NODE_VARIABLES:
        return None
    names, local = NODE_VARIABLES[launcher]
    node = next((env[name] for name in names if env.get(name, "").isdigit()), "-1")
    return int(node), local


# --- values in range ---


def check_ranks(rank, world, who):
    """rank, world: (variable, value). A world of at least 1 and a rank inside it, else one line
    naming the variables and `who` set them."""
    (rank_name, rank_value), (world_name, world_value) = rank, world
    if world_value < 1:
        raise ConfigError(
            f"{world_name}={world_value} ({who}): a job has at least one rank; check the launcher "
            "that set it"
        )
    if not 0 <= rank_value < world_value:
        single = (
            " (for one process, unset RANK, WORLD_SIZE and MASTER_ADDR)"
            if world_value == 1 and world_name == "WORLD_SIZE"
            else ""
        )
        raise ConfigError(
            f"{rank_name}={rank_value} but {world_name}={world_value} ({who}): a rank runs from 0 "
            f"to {world_value - 1}; check the launcher that set them{single}"
        )


def check_local(local_rank, local_world_text, local_world, world, who):
    """0 <= local rank < ranks on this node <= world, else one line naming the variables."""
    name, value = local_rank
    if not 1 <= local_world <= world:
        raise ConfigError(
            f"{local_world_text} ({who}): {local_world} rank(s) on this node, but a world of "
            f"{world}: check the launcher that set them"
        )
    if not 0 <= value < local_world:
        raise ConfigError(
            f"{name}={value} but {local_world_text} ({who}): a local rank runs from 0 to "
            f"{local_world - 1}; check the launcher that set them"
        )


def check_master_port(env, who, required=False):
    """MASTER_PORT, where set (or `required`), is a port: 1 to 65535."""
    if "MASTER_PORT" not in env:
        if required:
            raise ConfigError(
                f"MASTER_ADDR is set ({who}) but not MASTER_PORT: export MASTER_PORT, a free port "
                "on rank 0's node (torchrun sets both)"
            )
        return
    port = int_variable(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ConfigError(
            f"MASTER_PORT={port} ({who}) is not a port (1 to 65535): export a free port on rank "
            "0's node, or unset MASTER_PORT to let rank 0 pick one (mpiexec, srun)"
        )


def _discover_srun(env):
    """Rank and layout from srun's task variables, checked against each other: the step's task
    counts per node must add up to its tasks, over its nodes, and this task's node and local ids
    must lie inside them."""
    world = int_variable(env, "SLURM_STEP_NUM_TASKS")
    rank = int_variable(env, "SLURM_PROCID")
    check_ranks(("SLURM_PROCID", rank), ("SLURM_STEP_NUM_TASKS", world), "srun")
    num_nodes = int_variable(env, "SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))
    # SLURM_STEP_TASKS_PER_NODE is the step's; SLURM_TASKS_PER_NODE, the job's, is the same for the
    # usual one step over the whole allocation.
    per_node_name = next(
        (name for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(name)),
        None,
    )
    per_node = env[per_node_name] if per_node_name else str(world)
    runs = tasks_per_node(per_node, per_node_name or "SLURM_STEP_NUM_TASKS")
    tasks, nodes = sum(t * n for t, n in runs), sum(n for _, n in runs)
    if tasks != world or nodes != num_nodes:
        raise ConfigError(
            f"{per_node_name}={per_node} (srun) is {tasks} task(s) on {nodes} node(s), "
            f"but SLURM_STEP_NUM_TASKS={world} over {num_nodes} node(s): the step's variables "
            "disagree; start the tasks with srun itself, with no variables of another step exported"
        )
    # srun sets it in every task; without it every rank would take local rank 0
    if "SLURM_LOCALID" not in env:
        raise ConfigError(
            "SLURM_LOCALID is not set but srun's step variables are: start the tasks with srun "
            "itself (a wrapper that drops variables loses each task's local rank)"
        )
    if "SLURM_NODEID" not in env and num_nodes > 1:
        raise ConfigError(
            f"SLURM_NODEID is not set in a step over {num_nodes} nodes: which node this task runs "
            "on is unknown; start the tasks with srun itself"
        )
    node = int_variable(env, "SLURM_NODEID", "0")
    if not 0 <= node < num_nodes:
        raise ConfigError(
            f"SLURM_NODEID={node} but the step runs on {num_nodes} node(s) (srun): start the tasks "
            "with srun itself, with no variables of another step exported"
        )
    local_world, local_rank = tasks_on_node(per_node, node), int_variable(env, "SLURM_LOCALID")
    text = f"{per_node_name or 'SLURM_STEP_NUM_TASKS'}={per_node} at SLURM_NODEID={node}"
    check_local(("SLURM_LOCALID", local_rank), text, local_world, world, "srun")
    check_master_port(env, "srun")
    return rank, world, local_rank, local_world, num_nodes


# --- MPI ---


def _launcher_world_size(env):
    """How many ranks an MPI launcher says it started, from its own variables (at least rank +
    1)."""
    for name in MPI_SIZE_VARIABLES:
        if name in env:
            return int_variable(env, name)
    ranks = [
        int_variable(env, name)
        for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID")
        if name in env
    ]
    return max(ranks) + 1 if ranks else 1


def _check_not_alone(world, env):
    """mpi4py built against another MPI than the launcher's does not fail: each process initializes
    a world of its own and trains alone. The launcher's variables tell."""
    expected = _launcher_world_size(env)
    if world.Get_size() == 1 and expected > 1:
        from mpi4py import MPI

        library = _library(MPI.Get_library_version())
        raise ConfigError(
            f"the launcher started {expected} ranks but mpi4py's MPI ({library}) sees a world of "
            "1: mpi4py is built against a different MPI than the launcher's. Use an mpi4py built "
            "for the site MPI (e.g. MPICC=cc pip install --no-binary mpi4py mpi4py), or under srun "
            "add --mpi=none; see docs/launch.md"
        )


def _discover_mpi(env, pbs, timeout):
    import mpi4py

    # MPI_Init below, once the variables are checked and under a deadline
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    from mpi4py import MPI

    _refuse_before_init(env, MPI.Get_library_version())
    with failures.deadline(timeout, "MPI discovery (MPI_Init and the split by host)"):
        if not MPI.Is_initialized():
            MPI.Init_thread()
        world = MPI.COMM_WORLD
        failures.agree_through(world.Dup())  # first: nothing below may leave another rank waiting
        _check_not_alone(world, env)
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        num_nodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
        found = world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size(), num_nodes
        problem = _disagreement(env, found)
        if not problem:
            try:
                check_master_port(env, "exported to mpiexec")
            except ConfigError as e:
                problem = str(e)
        if pbs and not problem:
            try:
                nodes, per_node = pbs_layout(found[1])
                if (nodes, per_node) != (num_nodes, found[3]):
                    problem = (
                        f"PBS_NODEFILE lists {nodes} node(s) x {per_node} rank(s) but MPI finds "
                        f"{num_nodes} host(s) with {found[3]} rank(s) on this one: start NODES*K "
                        "ranks with --ppn K over the nodes of the job"
                    )
            except ConfigError as e:
                problem = str(e)
        problems = world.allgather(problem)
    failures.raise_gathered(problems)
    return found


def _library(version):
    return " ".join(version.split("\n")[0].split())  # e.g. 'MPICH Version: 5.0.2'


def _refuse_before_init(env, version):
    """A PMIx launcher (Open MPI 5's mpirun/prterun) and an MPICH without PMIx: MPICH would abort
    inside MPI_Init with a stack per rank. Its own launcher (Hydra, Cray PALS) sets PMI_* variables;
    PMIx alone says another."""
    pmix = [name for name in ("PMIX_RANK", "PMIX_NAMESPACE") if name in env]
    pmi = any(name in env for name in ("PMI_RANK", "PMI_FD", "PMI_PORT", "PALS_RANKID"))
    if pmix and not pmi and version.startswith("MPICH") and "pmix" not in version.lower():
        named = ", ".join(f"{name}={env[name]}" for name in pmix)
        raise ConfigError(
            f"{named}: a PMIx launcher (Open MPI's mpirun or prterun) started this rank, but "
            f"mpi4py's MPI ({_library(version)}) cannot speak PMIx and would abort in MPI_Init: "
            "start with that MPI's own mpiexec, or use an mpi4py built for the launcher's MPI (see "
            "docs/launch.md)"
        )
    if "PMI_FD" in env and not _is_socket(env["PMI_FD"]):
        raise ConfigError(
            f"PMI_FD={env['PMI_FD']} is not an open socket to an MPI launcher: this process was "
            "not started by mpiexec (the variable was copied or exported), and MPI_Init would "
            "abort; start it with mpiexec, or unset PMI_FD, PMI_RANK and PMI_SIZE"
        )
    if "PALS_RANKID" in env and "PMI_SIZE" not in env:
        raise ConfigError(
            f"PALS_RANKID={env['PALS_RANKID']} but no PMI_SIZE: Cray's mpiexec sets both, so these "
            "processes were not started by it as one job and the world size is unknown; start them "
            "with mpiexec (see docs/launch.md)"
        )


def _is_socket(fd):
    """Whether `fd` (a launcher variable's text) is an open socket of this process, as Hydra's
    PMI_FD is."""
    try:
        return stat.S_ISSOCK(os.fstat(int(fd)).st_mode)
    except (ValueError, OSError):
        return False


# What launchers say about a rank, to check against MPI's own view: (variable, who sets it).
_VIEWS = {
    "world size": (
        ("PMI_SIZE", "mpiexec"),
        ("OMPI_COMM_WORLD_SIZE", "Open MPI"),
        ("WORLD_SIZE", "torchrun/PyTorchJob"),
    ),
    "rank": (
        ("PMI_RANK", "mpiexec"),
        ("OMPI_COMM_WORLD_RANK", "Open MPI"),
        ("PMIX_RANK", "PMIx"),
        ("PALS_RANKID", "Cray PALS"),
        ("RANK", "torchrun/PyTorchJob"),
    ),
    "local rank": (
        ("MPI_LOCALRANKID", "Hydra"),
        ("PMI_LOCAL_RANK", "Cray PALS"),
        ("PALS_LOCAL_RANKID", "Cray PALS"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
        ("LOCAL_RANK", "torchrun"),
    ),
    "ranks on this host": (
        ("MPI_LOCALNRANKS", "Hydra"),
        ("PMI_LOCAL_SIZE", "Cray PALS"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
        ("LOCAL_WORLD_SIZE", "torchrun"),
    ),
}


def _disagreement(env, found):
    """A line naming the first launcher variable that disagrees with MPI's view of this rank, or
    None."""
    rank, world, local_rank, local_world, _ = found
    mpi = {
        "world size": world,
        "rank": rank,
        "local rank": local_rank,
        "ranks on this host": local_world,
    }
    for what, variables in _VIEWS.items():
        for name, source in variables:
            if name == "PMIX_RANK" and "PMI_RANK" in env:
                # Hydra started by srun's PMIx plugin: its ranks inherit the srun task's PMIX_RANK
                continue
            if name in env and env[name] != str(mpi[what]):
                return (
                    f"two sources of rank information disagree: {name}={env[name]} ({source}) but "
                    f"MPI's {what} is {mpi[what]} (MPI_COMM_WORLD, split by shared memory): start "
                    "the job under one launcher, with no other launcher's variables exported"
                )
    return None


# --- SLURM's compressed lists ---


def first_host(nodelist):
    """The first host of a SLURM nodelist: 'gpu[07-09,12],cpu1' -> 'gpu07', 'r[1-2]-n[3-4]' ->
    'r1-n3'."""
    first, depth = "", 0
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    # Each bracketed range list contributes its first value, zero padding kept.
    return re.sub(r"\[([^],-]+)[^]]*\]", r"\1", first)


def tasks_per_node(text, name="SLURM_TASKS_PER_NODE"):
    """SLURM's compressed per-node task counts, '4(x2),3' -> [(4, 2), (3, 1)] (tasks, nodes): never
    expanded, as a repeat count can be as large as the nodes; one line if malformed."""
    runs = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d{1,9})(?:\(x(\d{1,9})\))?\s*", item)
        if not match:
            raise ConfigError(
                f"{name}={text[:200]!r} is not a list of task counts (e.g. '4(x2),3'): check the "
                "launcher that set it (SLURM's tasks per node)"
            )
        runs.append((int(match[1]), int(match[2] or 1)))
    return runs


def tasks_on_node(tasks_per_node_text, node_id):
    """SLURM's compressed per-node task counts, '4(x2),3' = 4,4,3, read at this node's index (the
    last node's past the end)."""
    runs = tasks_per_node(tasks_per_node_text)
    first = 0  # the first node of the current run
    for tasks, nodes in runs:
        first += nodes
        if node_id < first:
            return tasks
    return runs[-1][0]
