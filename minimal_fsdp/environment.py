"""Who am I, how many are we, and which device is mine: launch discovery, rendezvous and process-group setup.

Works under any MPI (mpiexec from the `mpich` wheel, Open MPI, Cray MPICH on PBS), under torchrun (and a
Kubernetes PyTorchJob, which starts torchrun), under SLURM's srun, and as a plain `python basic_training.py`
(world size 1). See docs/launch.md.

Detection order: torchrun's variables, then MPI's, then srun's. MPI comes before srun because an mpiexec
started inside a SLURM job inherits SLURM_* variables that describe the job (or Hydra's per-node proxies),
not the MPI ranks; only PMIx variables that srun's own plugin set (its namespace names the step) mean srun.

Rendezvous: rank 0 binds the TCPStore itself (on MASTER_PORT, on the step's reserved SLURM port, or on a free
port it then publishes) and marks it with a token of this job; the other ranks check the token, so a rank can
never join another job's store. Launch errors end the whole job with one line: under MPI the ranks agree on
every rendezvous error through MPI itself, and a rank that fails alone aborts the job (exit_on_error).
"""
import datetime
import gc
import hashlib
import os
import re
import secrets
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ConfigError

# Variables that MPI launchers set in every rank: MPICH/Hydra, Open MPI, PMIx, Cray PALS.
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "PMI_SIZE")
# Where a launcher says how many ranks it started (PMIx has no such variable).
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
TOKEN_KEY = "minimal_fsdp/launch_token"
FAILED_KEY = "minimal_fsdp/failed"
AGREE_SECONDS = 10  # how long a failing rank waits for the others to fail alike before it ends the job itself


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    device: torch.device
    backend: str
    launcher: str
    local_world_sizes: tuple = ()  # every rank's local world size, gathered: the same tuple on every rank

    @property
    def is_main(self):
        return self.rank == 0


_store = None  # the rendezvous store (rank 0's server, or another rank's client of it); None under torchrun
_store_file = None  # srun: where rank 0 published its port, removed once every rank has joined
_error_comm = None  # MPI: a duplicate of COMM_WORLD used only to agree on errors, so it is never busy
_setup_started = False
_known_world = None  # the world size, once discovered


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _int(env, name, default=None):
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


def _pbs_layout(world):
    """(nodes, ranks per node) from PBS_NODEFILE; every rank reads the same file, so all agree."""
    nodefile = os.environ.get("PBS_NODEFILE")
    if not nodefile or not os.path.exists(nodefile):
        raise ConfigError("--environment pbs needs PBS_NODEFILE (run inside a PBS job, or use --environment auto)")
    nodes = count_pbs_nodes(nodefile)
    if not nodes or world % nodes:
        raise ConfigError(f"--environment pbs: {world} rank(s) cannot be spread evenly over the {nodes} node(s) of "
                          "PBS_NODEFILE: start the same number of ranks on every node (mpiexec -n NODES*K --ppn K)")
    return nodes, world // nodes


# --- discovery: (rank, world, local rank, local world, nodes) ---

def _launcher_world_size(env):
    """How many ranks an MPI launcher says it started, from its own variables (at least rank + 1)."""
    for name in MPI_SIZE_VARIABLES:
        if name in env:
            return _int(env, name)
    ranks = [_int(env, name) for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID")
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


def _discover_mpi():
    from mpi4py import MPI

    global _error_comm
    world = MPI.COMM_WORLD
    install_abort_on_exception()  # first: nothing below may leave another rank waiting
    _error_comm = world.Dup()
    _check_not_alone(world, os.environ)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    num_nodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
    return world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size(), num_nodes


def _discover_srun(env):
    """Rank and layout from srun's task variables."""
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))
    # SLURM_STEP_TASKS_PER_NODE is the step's; SLURM_TASKS_PER_NODE, the job's, is the same for the usual
    # one step over the whole allocation.
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
    local_world = tasks_on_node(per_node, _int(env, "SLURM_NODEID", "0"))
    return _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", "0"), local_world, num_nodes


def _discover_torchrun(env):
    # A Kubeflow PyTorchJob sets RANK and WORLD_SIZE per pod, for torchrun to split among its processes;
    # read by a process that torchrun did not start (no LOCAL_RANK), they describe the wrong world.
    if "LOCAL_RANK" not in env and env.get("PET_NPROC_PER_NODE", "1") != "1":
        raise ConfigError(f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are the PyTorchJob pod's, for "
                          f"torchrun to split among PET_NPROC_PER_NODE={env['PET_NPROC_PER_NODE']} processes: "
                          "start basic_training.py with torchrun (see k8s/pytorchjob.yaml)")
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    return _int(env, "RANK"), world, _int(env, "LOCAL_RANK", "0"), local_world, max(1, world // local_world)


def _srun_pmix(env):
    """srun started this process through its PMIx plugin (`srun` without --mpi=none on a PMIx cluster): the
    PMIx namespace names this job step, and no mpiexec variables are set. Every task sees the same answer.
    srun's variables then give the layout, and MPI is never initialized (an mpi4py built against another
    MPI would abort in MPI_Init, or see a world of one)."""
    step = f"slurm.pmix.{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}"
    mpiexec_variables = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PALS_RANKID")
    return (env.get("PMIX_NAMESPACE") == step and "SLURM_STEP_NUM_TASKS" in env
            and not any(name in env for name in mpiexec_variables))


def _discover():
    """Returns (rank, world, local_rank, local_world, num_nodes, launcher)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:  # torchrun, Kubernetes PyTorchJob
        return (*_discover_torchrun(env), "torchrun")
    if _srun_pmix(env):
        return (*_discover_srun(env), "srun")
    if any(v in env for v in MPI_RANK_VARIABLES):
        return (*_discover_mpi(), "mpi")
    # srun sets SLURM_STEP_NUM_TASKS for the tasks it starts; a batch script also has SLURM_PROCID=0 and
    # SLURM_NTASKS, but is one process, so without the step variables it is a single rank.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return (*_discover_srun(env), "srun")
    return 0, 1, 0, 1, 1, "single"


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


# --- rendezvous: rank 0's TCPStore, marked with a token of this job ---

def _open_store(world, port, where, token, timeout):
    """Rank 0 binds the store itself (port 0: any free one), so no other job can take the port in between."""
    try:
        store = dist.TCPStore("0.0.0.0", port, world, is_master=True, wait_for_workers=False, timeout=timeout)
    except dist.DistNetworkError as e:
        if not port:
            raise ConfigError(f"rank 0 could not open a rendezvous port on {socket.gethostname()}: {e}") from None
        raise ConfigError(f"{where} {port} is already in use on {socket.gethostname()}: export another "
                          "MASTER_PORT, or unset it to let rank 0 pick a free port") from None
    store.set(TOKEN_KEY, token)
    return store


def _join_store(addr, port, world, token, timeout):
    """A client of rank 0's store, after checking that it is this job's."""
    try:
        socket.getaddrinfo(addr, port)  # TCPStore would retry an unknown name until the timeout
    except socket.gaierror:
        raise ConfigError(f"MASTER_ADDR {addr} does not resolve on {socket.gethostname()}: export MASTER_ADDR as "
                          "an address of rank 0's node that every node can reach") from None
    try:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    except dist.DistError:
        raise ConfigError(f"no rendezvous at {addr}:{port} after {timeout.total_seconds():.0f}s (from "
                          f"{socket.gethostname()}): rank 0 failed (see its error) or cannot be reached") from None
    try:  # rank 0 sets the token right after binding
        store.wait([TOKEN_KEY], min(timeout, datetime.timedelta(seconds=60)))
        theirs = store.get(TOKEN_KEY).decode()
    except dist.DistError:
        theirs = "no token"
    if theirs != token:
        raise ConfigError(f"the rendezvous at {addr}:{port} belongs to another job ({theirs}, expected {token}): "
                          "export another MASTER_PORT") from None
    return store


def _rendezvous_mpi(rank, world, num_nodes, timeout):
    """Rank 0 opens the store and broadcasts where; every rank joins, and all agree on any failure through MPI,
    so each raises the same error and none waits for another."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    offer = None
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if num_nodes == 1 else socket.gethostname())
        token = f"mpi {socket.gethostname()} {secrets.token_hex(8)}"
        try:
            store = _open_store(world, _int(os.environ, "MASTER_PORT", "0"), "MASTER_PORT", token, timeout)
            offer = (addr, store.port, token)
        except ConfigError as e:
            offer = str(e)
    offer = comm.bcast(offer, root=0)
    if isinstance(offer, str):
        raise ConfigError(offer)
    error = None
    if rank != 0:
        try:
            store = _join_store(*offer[:2], world, offer[2], timeout)
        except ConfigError as e:
            error = f"rank {rank}: {e}"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise ConfigError(errors[0] + (f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""))
    return store


def _srun_address(env):
    """(address, port, where the port came from) of an srun step's rendezvous. Port 0: rank 0 binds a free
    port and publishes it in a file (a port derived from the job id would collide between jobs)."""
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if num_nodes == 1 else first_host(nodelist))
    if "MASTER_PORT" in env:
        return addr, _int(env, "MASTER_PORT"), "MASTER_PORT"
    reserved = re.match(r"\d+", env.get("SLURM_STEP_RESV_PORTS", ""))  # srun --resv-ports: '12000-12003'
    if reserved:
        return addr, int(reserved[0]), "SLURM_STEP_RESV_PORTS's port"
    return addr, 0, None


def _rendezvous_srun(rank, world, cfg, timeout):
    """Every task knows the address, and the port unless rank 0 publishes it; the token is the job step's."""
    global _store_file
    env = os.environ
    addr, port, where = _srun_address(env)
    job = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}.{env.get('SLURM_RESTART_COUNT', '0')}"
    token = f"slurm {job}"
    # The checkpoint directory is on a file system every node shares (all ranks write checkpoints there).
    _store_file = Path(cfg.checkpoint_dir) / ".rendezvous" / f"slurm-{job}"
    if rank == 0:
        store = _open_store(world, port, where, token, timeout)
        if not port:
            _store_file.parent.mkdir(parents=True, exist_ok=True)
            partial = _store_file.with_name(_store_file.name + ".tmp")
            partial.write_text(str(store.port))
            os.replace(partial, _store_file)
        return store
    if not port:
        port = _published_port(_store_file, timeout.total_seconds())
    return _join_store(addr, port, world, token, timeout)


def _published_port(path, timeout):
    """The port rank 0 wrote into `path`, once it is there."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise ConfigError(f"rank 0 did not publish its rendezvous port in {path} within {timeout:.0f}s: see "
                              "rank 0's error; --checkpoint_dir must be on a file system that every node shares")
        time.sleep(0.5)
    return int(path.read_text())


def _rendezvous(rank, world, num_nodes, launcher, cfg):
    """The store every rank passes to init_process_group; None under torchrun, whose agent provides one."""
    timeout = datetime.timedelta(seconds=cfg.collective_timeout)
    if launcher == "single":
        return dist.HashStore()
    if launcher == "mpi":
        return _rendezvous_mpi(rank, world, num_nodes, timeout)
    if launcher == "srun":
        return _rendezvous_srun(rank, world, cfg, timeout)
    return None


# --- setup ---

def cpu_threads(local_world, environ=os.environ):
    """Intra-op threads for one of local_world ranks on this host: OMP_NUM_THREADS if set (PBS, SLURM and
    torchrun set it), else an equal share of the cores this process may run on. Without a share every rank
    starts a thread per core: 4 ranks on a 64-core host would run 256."""
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, (os.cpu_count() or 1) // local_world))


def _pick_device(local_rank, local_world):
    threads = cpu_threads(local_world)
    torch.set_num_threads(threads)
    # torch.compile's worker pool: by default 32 processes per rank (128 for 4 ranks on 64 cores), started
    # whether or not the cache already holds the kernels.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device, "cpu:gloo,cuda:nccl"  # gloo serves CPU tensors, e.g. grad norms of CPU-offloaded shards
    return torch.device("cpu"), "gloo"


def _gpu_key(device):
    """A number naming this rank's physical GPU (0 on CPU): equal on two ranks only if they share the GPU."""
    if device.type != "cuda":
        return 0
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return int(hashlib.sha1(uuid.encode()).hexdigest()[:15], 16)


def shared_gpus_warning(gpu_keys):
    """The warning rank 0 prints when ranks share GPUs (more ranks than GPUs on a node), else None."""
    gpus = {key for key in gpu_keys if key}
    if len(gpus) == len([key for key in gpu_keys if key]):
        return None
    return (f"warning: {len(gpu_keys)} ranks share {len(gpus)} GPU(s): each rank takes GPU local_rank % (GPUs it "
            "sees), so some GPUs run several ranks; start one rank per GPU")


def _gather_layout(local_world, device):
    """Every rank's (local world size, GPU key), so checks of the layout reach the same verdict on every rank."""
    mine = torch.tensor([local_world, _gpu_key(device)], dtype=torch.int64)  # CPU: gloo, no GPU wait
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return tuple(int(t[0]) for t in everyone), [int(t[1]) for t in everyone]


def setup(cfg):
    """Discover the layout, pick the device, meet at the rendezvous and initialize torch.distributed (always,
    even for one rank, so every code path below is the same FSDP path)."""
    global _setup_started, _known_world, _store
    _setup_started = True
    rank, world, local_rank, local_world, num_nodes, launcher = _discover()
    _known_world = world
    if cfg.environment == "pbs":
        num_nodes, local_world = _pbs_layout(world)
    device, backend = _pick_device(local_rank, local_world)
    _store = _rendezvous(rank, world, num_nodes, launcher, cfg)
    store = dict(store=_store) if _store is not None else {}
    with gloo_quiet():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.collective_timeout),
                                device_id=device if device.type == "cuda" else None, **store)
        local_world_sizes, gpu_keys = _gather_layout(local_world, device)
    if rank == 0 and _store_file is not None:
        _store_file.unlink(missing_ok=True)  # every rank has joined
    warning = shared_gpus_warning(gpu_keys)
    if warning and rank == 0:
        print(warning, file=sys.stderr, flush=True)
    return DistEnv(rank, world, local_rank, local_world, num_nodes, device, backend, launcher, local_world_sizes)


@contextmanager
def gloo_quiet():
    """The C-level stdout goes to /dev/null while gloo connects a process group: torch 2.9's gloo prints a line
    there for each (pytorch/gloo#462; quiet in later torch), and stdout carries a sample's text alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def teardown():
    """Destroy every process group while the interpreter is fully alive; gc first, so that groups held only
    by garbage (cycles through FSDP or DTensor state) are gone with them."""
    global _store, _store_file
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    _store = _store_file = None


# --- failures: the whole job ends, with one line ---

def install_abort_on_exception():
    """An uncaught exception on one rank must end the whole MPI job, not leave the others in a collective."""

    def hook(kind, value, tb):
        # Written straight to the process's stderr: torch's own hook (which init_process_group wraps around
        # this one) buffers what it wraps, and the buffer would die with the Abort below.
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.__stderr__.write("".join(f"[rank{rank_hint()}]: {line}" for line in text.splitlines(True)))
        if "timed out" in str(value).lower():
            print(f"error: rank {rank_hint()} waited longer than --collective_timeout in a collective: another rank "
                  "has died or hangs", file=sys.__stderr__)
        sys.__stderr__.flush()
        time.sleep(1)  # let the launcher forward the traceback before Abort tears the job down
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def _failed_alike(timeout=AGREE_SECONDS):
    """Whether every rank has failed too (within `timeout` seconds): then rank 0 speaks for all."""
    if not _setup_started or _known_world == 1:
        return True  # before setup only the flags can be wrong, and every rank parses the same ones
    if _error_comm is not None:
        request = _error_comm.Ibarrier()  # only failing ranks enter it; nobody else uses this communicator
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True
    if dist.is_initialized():  # srun, torchrun: count the failures in the rendezvous store
        try:
            store = dist.distributed_c10d._get_default_store()  # torch has no public accessor
            store.add(FAILED_KEY, 1)
            deadline = time.monotonic() + timeout
            while store.add(FAILED_KEY, 0) < dist.get_world_size():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
            return True
        except dist.DistError:  # rank 0, which holds the store, is gone
            return False
    return False  # failed in the rendezvous, which is this rank's own


def exit_on_error(error, code):
    """Print `error: ...` once and end the process with `code`. Ranks that failed alike exit cleanly and rank 0
    speaks for all; a rank that failed alone prints its own line and ends the job, because the other ranks
    would wait for it in a collective (MPI: Abort; srun --kill-on-bad-exit and torchrun stop the rest)."""
    if _failed_alike():
        if rank_hint() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        teardown()
        sys.exit(code)
    print(f"error: rank {rank_hint()}: {error}", file=sys.stderr, flush=True)
    if _error_comm is not None:
        time.sleep(1)  # let the launcher forward the line first
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # skip interpreter shutdown, which would wait for the peers in process-group teardown


def run_on_main(fn, *args):
    """Run fn on rank 0 only (e.g. preparing data) while the others wait; every rank returns its result or
    raises its error, so a failure on rank 0 can never leave the others waiting forever."""
    outcome = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = fn(*args)
        except ConfigError as e:
            outcome[1] = str(e)
        except Exception as e:  # report unexpected failures the same way, with the traceback on rank 0
            traceback.print_exc()
            outcome[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise ConfigError(outcome[1])
    return outcome[0]


def rank_hint():
    """This process's global rank, also before (or without) torch.distributed: for printing errors once."""
    if dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "SLURM_PROCID"):
        if name in os.environ and os.environ[name].isdigit():
            return int(os.environ[name])
    return 0
