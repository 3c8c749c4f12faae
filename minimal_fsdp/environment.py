"""Who am I, how many are we, and which device is mine: launch discovery and process-group setup.

Works under any MPI (mpiexec from the `mpich` wheel, Open MPI, Cray MPICH on PBS), under torchrun (and a
Kubernetes PyTorchJob, which starts torchrun), under SLURM's srun, and as a plain `python basic_training.py`
(world size 1). Under MPI, rank 0 picks the rendezvous address and port and broadcasts them, so no
launcher-specific environment variables are needed.

Detection order: torchrun's variables, then MPI's, then srun's. MPI comes before srun because an mpiexec
started inside a SLURM job inherits SLURM_* variables that describe the job (or Hydra's per-node proxies),
not the MPI ranks.
"""
import datetime
import gc
import os
import re
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError

# Variables that MPI launchers set in every rank: MPICH/Hydra, Open MPI, PMIx, Cray PALS.
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "PMI_SIZE")


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

    @property
    def is_main(self):
        return self.rank == 0


_store = None  # under MPI, when rank 0 picked the port: its rendezvous store, or another rank's client of it


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _count_pbs_nodes():
    nodefile = os.environ.get("PBS_NODEFILE")
    if not nodefile or not os.path.exists(nodefile):
        raise ConfigError("--environment pbs needs PBS_NODEFILE (run inside a PBS job, or use --environment local)")
    with open(nodefile) as f:
        return len({line.strip() for line in f if line.strip()})


def _discover_mpi():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    num_nodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
    global _store
    rendezvous = None
    if world.Get_rank() == 0:
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if num_nodes == 1 else socket.gethostname())
        port = os.environ.get("MASTER_PORT")
        if port is None:
            # Rank 0 binds the rendezvous store to a free port itself and keeps it: a port found free and then
            # released could be taken by another job before the store binds it.
            _store = dist.TCPStore("0.0.0.0", 0, world.Get_size(), is_master=True, wait_for_workers=False)
            port = str(_store.port)
        rendezvous = (addr, port, _store is not None)
    addr, port, own_store = world.bcast(rendezvous, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
    if own_store and world.Get_rank() != 0:
        _store = dist.TCPStore(addr, int(port), world.Get_size(), is_master=False)
    return world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size(), num_nodes


def _discover_srun(env):
    """Rank and layout from srun's task variables. Every task computes the same rendezvous without talking:
    the step's first node (127.0.0.1 on one node) and a port derived from the job and step ids; an exported
    MASTER_ADDR or MASTER_PORT wins."""
    num_nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    env.setdefault("MASTER_ADDR", "127.0.0.1" if num_nodes == 1 else first_host(nodelist))
    job, step = (env.get(name, "0") for name in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
    job, step = (int(v) if v.isdigit() else 0 for v in (job, step))
    env.setdefault("MASTER_PORT", str(20000 + (job * 16 + step) % 12000))  # below Linux's ephemeral range
    world = int(env["SLURM_STEP_NUM_TASKS"])
    local_world = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world)), int(env.get("SLURM_NODEID", "0")))
    return int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", "0")), local_world, num_nodes


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


def _discover(environment):
    """Returns (rank, world, local_rank, local_world, num_nodes, launcher)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:  # torchrun, Kubernetes PyTorchJob
        world, local_world = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        return (int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world,
                max(1, world // local_world), "torchrun")
    if any(v in env for v in MPI_RANK_VARIABLES):
        return (*_discover_mpi(), "mpi")
    # srun sets SLURM_STEP_NUM_TASKS for the tasks it starts; a batch script also has SLURM_PROCID=0 and
    # SLURM_NTASKS, but is one process, so without the step variables it is a single rank.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return (*_discover_srun(env), "srun")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    return 0, 1, 0, 1, 1, "single"


def setup(cfg):
    """Discover the layout, pick the device, and initialize torch.distributed (always, even for one rank,
    so every code path below is the same FSDP path)."""
    rank, world, local_rank, local_world, num_nodes, launcher = _discover(cfg.environment)
    if cfg.environment == "pbs":
        num_nodes = _count_pbs_nodes()
        local_world = max(1, world // num_nodes)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo serves CPU tensors, e.g. grad norms of CPU-offloaded shards
    else:
        device, backend = torch.device("cpu"), "gloo"
        # Ranks on one host share its cores; without this each would start a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    store = dict(store=_store) if _store is not None else {}  # every rank passes one, or none does
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.collective_timeout),
                            device_id=device if device.type == "cuda" else None, **store)
    if launcher == "mpi":
        # Installed after init_process_group, so that torch's hook (which buffers the traceback to prefix it
        # with the rank) runs inside ours and has written it before Abort ends the process.
        install_abort_on_exception()
    return DistEnv(rank, world, local_rank, local_world, num_nodes, device, backend, launcher)


def teardown():
    """Destroy every process group while the interpreter is fully alive; gc first, so that groups held only
    by garbage (cycles through FSDP or DTensor state) are gone with them."""
    global _store
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    _store = None


def install_abort_on_exception():
    """An uncaught exception on one rank must end the whole MPI job, not leave the others in a collective."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if "timed out" in str(value).lower():
            print(f"error: rank {rank_hint()} waited longer than --collective_timeout in a collective: another rank "
                  "has died or hangs", file=sys.stderr)
        sys.stderr.flush()
        time.sleep(1)  # let the launcher forward the traceback before Abort tears the job down
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


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
        if name in os.environ:
            return int(os.environ[name])
    return 0
