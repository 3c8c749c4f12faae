"""The launch of a run: setup() finds every rank's place, picks its device, meets the others and
initializes torch.distributed; teardown() lets go of it. The steps live in their own modules:

    discovery   who am I, how many are we: rank, world, local rank, hosts (torchrun, MPI, srun, PBS)
    rendezvous  where the ranks meet: rank 0's TCPStore, marked with a token of this job
    failures    how a failure ends the job with one line (exit_on_error, run_on_main)

Works under any MPI (mpiexec from the `mpich` wheel, Open MPI, Cray MPICH on PBS), under torchrun
(and a Kubernetes PyTorchJob, which starts torchrun), under SLURM's srun, and as a plain `python
basic_training.py` (world size 1). See docs/launch.md.
"""

import datetime
import hashlib
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.launch import discovery, failures, hangs, hosts, rendezvous

# past --collective_timeout, before a wait for the process group is ended from outside
GRACE_SECONDS = 5


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
    # every rank's local world size, gathered: the same tuple on every rank
    local_world_sizes: tuple = ()

    @property
    def is_main(self):
        return self.rank == 0

    def describe(self):
        return hosts.layout_line(self)


def setup(launch):
    """Discover the layout, pick the device, meet at the rendezvous and initialize torch.distributed
    (always, even for one rank, so every code path below is the same FSDP path). `launch`: the
    flags it reads (config.sections.Launch)."""
    failures.setup_started()
    launcher = discovery.launcher_of(os.environ)
    if launcher == "mpi":
        # Process-wide: from here on, an uncaught exception on one rank aborts the whole MPI job.
        failures.abort_job_on_uncaught_exception()
    rank, world, local_rank, local_world, num_nodes = discovery.discover(
        launcher, os.environ, pbs=launch.environment == "pbs", timeout=launch.collective_timeout
    )
    failures.world_known(world)
    device, backend = _pick_device(local_rank, local_world)
    with _until_grouped(launcher, rank, world, launch.collective_timeout):
        store = rendezvous.meet(rank, world, num_nodes, launcher, launch)
        # before gloo picks an address itself
        network = hosts.pick_interface(rendezvous.address(), num_nodes)
        hosts.nccl_socket_threads(num_nodes)  # before NCCL's first communicator reads them
        hangs.record()  # the flight recorder, for the line a collective timeout ends with
        with hosts.gloo_quiet():
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=launch.collective_timeout),
                device_id=device if device.type == "cuda" else None,
                **(dict(store=store) if store is not None else {}),
            )
            local_world_sizes, gpu_keys, clash = _gather_layout(
                local_rank, local_world, device, discovery.node_of(launcher, os.environ)
            )
    rendezvous.all_joined(rank)
    if clash:  # gathered alike: every rank raises the same line
        raise ConfigError(clash)
    hosts.check_shared_dir(launch.checkpoint_dir, num_nodes)
    if network and rank == 0:
        print(network, flush=True)
    warning = shared_gpus_warning(gpu_keys)
    if warning and rank == 0:
        print(warning, file=sys.stderr, flush=True)
    return DistEnv(
        rank,
        world,
        local_rank,
        local_world,
        num_nodes,
        device,
        backend,
        launcher,
        local_world_sizes,
    )


def _until_grouped(launcher, rank, world, timeout):
    """srun and torchrun: every wait until the process group exists, under one deadline of
    --collective_timeout. A store's client waits for its server's answer without any timeout
    (TCPStore's ping), so a rank 0 stopped right after publishing its port held the others for good.
    MPI's steps have deadlines of their own. Rank 0, whose store the others wait for, is ended last:
    the line then comes from a rank that waited."""
    if launcher in ("srun", "torchrun") and world > 1:
        return failures.deadline(
            timeout,
            "the rendezvous (joining rank 0's store and the process group)",
            grace=GRACE_SECONDS * (2 if rank == 0 else 1),
        )
    return nullcontext()


def teardown():
    """Destroy every process group (while the interpreter is fully alive) and drop the rendezvous
    store."""
    failures.end_process_groups()
    rendezvous.forget()


# --- the device ---


def cpu_threads(local_world, environ=os.environ):
    """Intra-op threads for one of local_world ranks on this host (threads_choice's number)."""
    return threads_choice(local_world, environ)[0]


def threads_choice(local_world, environ=os.environ, load=None):
    """(threads, why) for one of local_world ranks on this host: OMP_NUM_THREADS if set (PBS,
    SLURM and torchrun set it); else an equal share of the cores this process may run on, cut to
    the cores the rest of the machine leaves idle (its 1-minute load average; load: given, for
    tests). Without a share every rank starts a thread per core: 4 ranks on a 64-core host would
    run 256. Without the cut, one process on 2 cores shared by a dozen busy ones ran `sample` about
    twice as slowly with 2 threads as with 1 (2026-11-29, load 12-15): torch's threads wait on each
    other at every parallel region, and a thread that loses its core stalls the rest."""
    given = environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given), f"OMP_NUM_THREADS={given}"
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    share = max(1, min(cores, (os.cpu_count() or 1) // local_world))
    why = f"{cores} core(s), {local_world} rank(s) on this host"
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    # the load is the whole machine's; a rank may be bound to fewer cores (its affinity) than that
    idle = round(((os.cpu_count() or 1) - load) / local_world)
    if idle < share:
        return max(1, idle), f"{why}, load {load:.1f}: cut to the idle cores"
    return share, why


THREADS = {"line": None}  # what _pick_device chose, for the training banner (banner.banner)


def _pick_device(local_rank, local_world):
    threads, why = threads_choice(local_world)
    THREADS["line"] = f"{threads} CPU thread(s) per rank ({why})"
    torch.set_num_threads(threads)
    # torch.compile's worker pool: by default 32 processes per rank (128 for 4 ranks on 64 cores),
    # started whether or not the cache already holds the kernels.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # gloo serves CPU tensors, e.g. grad norms of CPU-offloaded shards
        return device, "cpu:gloo,cuda:nccl"
    return torch.device("cpu"), "gloo"


def _gpu_key(device):
    """A number naming this rank's physical GPU (0 on CPU): equal on two ranks only if they share
    the GPU."""
    if device.type != "cuda":
        return 0
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return int(hashlib.sha1(uuid.encode()).hexdigest()[:15], 16)


def shared_gpus_warning(gpu_keys):
    """The warning rank 0 prints when ranks share GPUs (more ranks than GPUs on a node), else
    None."""
    gpus = {key for key in gpu_keys if key}
    if len(gpus) == len([key for key in gpu_keys if key]):
        return None
    return (
        f"warning: {len(gpu_keys)} ranks share {len(gpus)} GPU(s): each rank takes GPU local_rank "
        "% (GPUs it sees), so some GPUs run several ranks; start one rank per GPU"
    )


def _gather_layout(local_rank, local_world, device, node):
    """Every rank's local world size and GPU key, and a line if two ranks of one node claim the same
    local rank (or a node's rank count disagrees with its ranks' view; see hosts.local_rank_clash),
    so that checks of the layout reach the same verdict on every rank. node: discovery.node_of's
    answer, None where the launcher's layout needs no check."""
    node_id, variable = node if node is not None else (-1, None)
    # CPU: gloo, no GPU wait
    mine = torch.tensor(
        [local_world, _gpu_key(device), hosts.host_key(), node_id, local_rank], dtype=torch.int64
    )
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    rows = [[int(x) for x in t] for t in everyone]
    clash = None
    if node is not None:
        clash = hosts.local_rank_clash([(r[2], r[3], r[4], r[0]) for r in rows], variable)
    return tuple(r[0] for r in rows), [r[1] for r in rows], clash
