"""Where the ranks meet: the TCPStore that init_process_group uses, opened by rank 0 and marked with
a token of this job.

Rank 0 binds the store itself (on MASTER_PORT, on the step's reserved SLURM port, or on a free port
it then publishes) and marks it with a token of this job; the other ranks check the token, so a rank
can never join another job's store. Under MPI the ranks agree on every rendezvous error through MPI
itself.
"""

import datetime
import os
import re
import secrets
import socket
import time
from pathlib import Path

import torch.distributed as dist

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.launch import failures, hosts
from minimal_fsdp.launch.discovery import first_host, int_variable

TOKEN_KEY = "minimal_fsdp/launch_token"
REACH_SECONDS = 30  # how long a rank tries to reach rank 0's store address before it says it cannot

# the rendezvous store (rank 0's server, or another rank's client of it); None under torchrun
_store = None
_store_file = None  # srun: where rank 0 published its port, removed once every rank has joined
_address = None  # where the ranks met: rank 0's address (MPI, srun)


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _open_store(world, port, where, token, timeout):
    """Rank 0 binds the store itself (port 0: any free one), so no other job can take the port in
    between."""
    # The server listens on every address whatever the name; the name is where rank 0's own
    # client connects. 127.0.0.1, not 0.0.0.0: c10d names the addresses it logs, and a node with
    # no reachable name server names 127.0.0.1 from /etc/hosts but not 0.0.0.0 (a warning, it was)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=True, wait_for_workers=False, timeout=timeout
        )
    except dist.DistNetworkError as e:
        if not port:
            raise ConfigError(
                f"rank 0 could not open a rendezvous port on {socket.gethostname()}: {e}"
            ) from None
        raise ConfigError(
            f"{where} {port} is already in use on {socket.gethostname()}: export another "
            "MASTER_PORT, or unset it to let rank 0 pick a free port"
        ) from None
    store.set(TOKEN_KEY, token)
    return store


def _check_reachable(addr, port, timeout):
    """One plain connection to rank 0's store first: TCPStore retries an unknown name or an
    unreachable address until its timeout and then ends in tracebacks; this says so in one line
    within REACH_SECONDS at most."""
    try:
        socket.getaddrinfo(addr, port)
    except (socket.gaierror, UnicodeError):
        raise ConfigError(
            f"MASTER_ADDR {addr} does not resolve on {socket.gethostname()}: export MASTER_ADDR as "
            "an address of rank 0's node that every node can reach"
        ) from None
    seconds = min(timeout.total_seconds(), REACH_SECONDS)
    try:
        socket.create_connection((addr, port), timeout=seconds).close()
    except OSError as e:
        reason = e.strerror or f"no answer within {seconds:.0f}s"
        raise ConfigError(
            f"cannot reach the rendezvous at {addr}:{port} from {socket.gethostname()} ({reason}): "
            "export MASTER_ADDR as an address of rank 0's node that every node can reach"
        ) from None


def _join_store(addr, port, world, token, timeout):
    """A client of rank 0's store, after checking that it is this job's."""
    _check_reachable(addr, port, timeout)
    try:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    except dist.DistError:
        raise ConfigError(
            f"no rendezvous at {addr}:{port} after {timeout.total_seconds():.0f}s (from "
            f"{socket.gethostname()}): rank 0 failed (see its error) or cannot be reached"
        ) from None
    try:  # rank 0 sets the token right after binding
        store.wait([TOKEN_KEY], min(timeout, datetime.timedelta(seconds=60)))
        theirs = store.get(TOKEN_KEY).decode()
    except dist.DistError:
        theirs = "no token"
    if theirs != token:
        raise ConfigError(
            f"the rendezvous at {addr}:{port} belongs to another job ({theirs}, expected {token}): "
            "export another MASTER_PORT"
        ) from None
    return store


def _rendezvous_mpi(rank, world, num_nodes, timeout):
    """Rank 0 opens the store and broadcasts where; every rank joins, and all agree on any failure
    through MPI, so each raises the same error and none waits for another."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    global _address
    offer = None
    # collective; one the other hosts reach, not a hostname
    addr = hosts.offered_address(comm, num_nodes)
    if rank == 0:
        token = f"mpi {socket.gethostname()} {secrets.token_hex(8)}"
        try:
            store = _open_store(
                world, int_variable(os.environ, "MASTER_PORT", "0"), "MASTER_PORT", token, timeout
            )
            offer = (addr, store.port, token)
        except ConfigError as e:
            offer = str(e)
    offer = comm.bcast(offer, root=0)
    if isinstance(offer, str):
        raise ConfigError(offer)
    _address = offer[0]
    error = None
    try:
        if rank == 0:
            _check_reachable(*offer[:2], timeout)  # MASTER_ADDR names rank 0's own node
        else:
            store = _join_store(*offer[:2], world, offer[2], timeout)
    except ConfigError as e:
        error = str(e)
    errors = comm.allgather(error)
    failures.raise_gathered(errors)
    return store


def _srun_address(env):
    """(address, port, where the port came from) of an srun step's rendezvous. Port 0: rank 0 binds
    a free port and publishes it in a file (a port derived from the job id would collide between
    jobs)."""
    num_nodes = int_variable(env, "SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if num_nodes == 1 else first_host(nodelist))
    if "MASTER_PORT" in env:
        return addr, int_variable(env, "MASTER_PORT"), "MASTER_PORT"
    # srun --resv-ports: '12000-12003'
    reserved = re.match(r"\d+", env.get("SLURM_STEP_RESV_PORTS", ""))
    if reserved:
        return addr, int(reserved[0]), "SLURM_STEP_RESV_PORTS's port"
    return addr, 0, None


def _rendezvous_srun(rank, world, launch, timeout):
    """Every task knows the address, and the port unless rank 0 publishes it; the token is the job
    step's."""
    global _store_file, _address
    env = os.environ
    addr, port, where = _srun_address(env)
    _address = addr
    job = (
        f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}."
        f"{env.get('SLURM_RESTART_COUNT', '0')}"
    )
    token = f"slurm {job}"
    # The checkpoint directory is on a file system every node shares (all ranks write checkpoints
    # there).
    _store_file = Path(launch.checkpoint_dir) / ".rendezvous" / f"slurm-{job}"
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
            raise ConfigError(
                f"rank 0 did not publish its rendezvous port in {path} within {timeout:.0f}s: see "
                "rank 0's error; --checkpoint_dir must be on a file system that every node shares"
            )
        time.sleep(0.5)
    return int(path.read_text())


def meet(rank, world, num_nodes, launcher, launch):
    """The store every rank passes to init_process_group; None under torchrun, whose agent provides
    one."""
    global _store
    timeout = datetime.timedelta(seconds=launch.collective_timeout)
    if launcher == "single":
        _store = dist.HashStore()
    elif launcher == "mpi":
        # MPI's collectives have no timeout of their own: a rank that stops here must not hold the
        # others.
        with failures.deadline(2 * launch.collective_timeout + 60, "the rendezvous"):
            _store = _rendezvous_mpi(rank, world, num_nodes, timeout)
    elif launcher == "srun":
        _store = _rendezvous_srun(rank, world, launch, timeout)
    return _store


def address():
    """The address the ranks met at: rank 0's host (MASTER_ADDR under torchrun)."""
    return _address or os.environ.get("MASTER_ADDR", "127.0.0.1")


def all_joined(rank):
    """Every rank has joined: rank 0 removes the port it published (srun)."""
    if rank == 0 and _store_file is not None:
        _store_file.unlink(missing_ok=True)


def forget():
    """The run is over: drop the store (its server, on rank 0, stops with it)."""
    global _store, _store_file, _address
    _store = _store_file = _address = None
