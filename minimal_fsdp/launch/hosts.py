"""Guard rails of a job that spans hosts: the network interface gloo and NCCL use, the address rank
0 offers under MPI, and a --checkpoint_dir that every host must share.

Gloo advertises the address its host's name resolves to, and falls back to 127.0.0.1 where the name
does not resolve (a common misconfiguration): the other hosts then cannot connect, and the job ends
in tracebacks or hangs. So a job on several hosts picks the interface itself, from the route to the
rendezvous address, unless GLOO_SOCKET_IFNAME says otherwise, and says which in its log. A
checkpoint directory on a node-local disk is found before training (each host looks for a file rank
0 wrote), not at resume time as missing shards.
"""

import fcntl
import hashlib
import ipaddress
import os
import secrets
import socket
import struct
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from minimal_fsdp.config.choices import ConfigError

# <linux/sockios.h>: the IPv4 address and netmask of an interface
SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B
# NCCL over TCP (hosts without InfiniBand or an OFI plugin, which ignore these): NCCL's defaults,
# one thread with one socket per connection, moved gossip's send/receive at 13 of 24 Gbit/s and an
# all-reduce at 19; 2 threads of 4 sockets each moved both at the link's rate
# (benchmarks/link_probe.py, 2 hosts x 1 GPU). The user's values stay.
NCCL_SOCKET_DEFAULTS = {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "4"}


def _ioctl_address(name, request):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), request, struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def interfaces():
    """{name: ipaddress.IPv4Interface} of this host's interfaces that have an IPv4 address."""
    found = {}
    for _, name in socket.if_nameindex():
        try:
            found[name] = ipaddress.IPv4Interface(
                f"{_ioctl_address(name, SIOCGIFADDR)}/{_ioctl_address(name, SIOCGIFNETMASK)}"
            )
        except OSError:  # no IPv4 address
            pass
    return found


def route_source(address):
    """The local address the kernel would send from to reach `address` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]


def pick_interface(master_addr, num_nodes, environ=os.environ):
    """On several hosts, the interface gloo and NCCL use: GLOO_SOCKET_IFNAME if set (checked), else
    the one on the route to master_addr, exported as GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME
    unless set). Returns a line for the log, or None on one host."""
    if num_nodes <= 1:
        return None
    found = interfaces()
    given = environ.get("GLOO_SOCKET_IFNAME")
    if given:
        names = [name.strip() for name in given.split(",")]
        bad = [name for name in names if name not in found or found[name].ip.is_loopback]
        if bad:
            raise ConfigError(
                f"GLOO_SOCKET_IFNAME={given} on {socket.gethostname()}: {', '.join(bad)} is not an "
                f"interface that other hosts can reach (here: {_listing(found)}); unset it to let "
                f"minimal_fsdp pick the interface on the route to {master_addr}"
            )
        return f"network: gloo over GLOO_SOCKET_IFNAME={given} (as set)"
    try:
        source = ipaddress.IPv4Address(route_source(socket.gethostbyname(master_addr)))
    except (OSError, UnicodeError) as e:
        raise ConfigError(
            f"no route from {socket.gethostname()} to the rendezvous address {master_addr} ({e}): "
            "export MASTER_ADDR as an address of rank 0's host that every host can reach"
        ) from None
    name = next((name for name, iface in found.items() if iface.ip == source), None)
    if source.is_loopback or name is None:
        raise ConfigError(
            f"the rendezvous address {master_addr} is this host's loopback, but the job spans "
            f"{num_nodes} hosts: export MASTER_ADDR as rank 0's address on a network every host "
            f"reaches (here: {_listing(found)})"
        )
    environ["GLOO_SOCKET_IFNAME"] = name
    environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return (
        f"network: {name} ({source}), the route to {master_addr} (GLOO_SOCKET_IFNAME unset: picked)"
    )


def nccl_socket_threads(num_nodes, environ=os.environ):
    """On several hosts, NCCL_SOCKET_DEFAULTS for each of the two variables the user did not set."""
    if num_nodes > 1:
        for key, value in NCCL_SOCKET_DEFAULTS.items():
            environ.setdefault(key, value)


def _listing(found):
    return ", ".join(f"{name} {iface.ip}" for name, iface in found.items()) or "no IPv4 interface"


def offered_address(comm, num_nodes):
    """Under MPI, the address rank 0 offers for the rendezvous (collective: every rank calls it):
    MASTER_ADDR if set, 127.0.0.1 on one host, else rank 0's IPv4 address that shares a network with
    every other host (its hostname may not resolve elsewhere). Every rank gets the same answer."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if num_nodes == 1:
        return "127.0.0.1"
    mine = [iface for iface in interfaces().values() if not iface.ip.is_loopback]
    everyone = comm.allgather((socket.gethostname(), [str(iface) for iface in mine]))
    if comm.Get_rank() != 0:
        return comm.bcast(None, root=0)
    return comm.bcast(reachable_address(everyone), root=0)


def reachable_address(everyone):
    """everyone: [(hostname, ['10.0.0.1/24', ...])] with rank 0 first. Rank 0's address in a network
    that every other host has an address in; else the one in most hosts' networks; else its
    hostname."""
    host0, mine = everyone[0]
    others = [
        [ipaddress.IPv4Interface(a) for a in addresses]
        for host, addresses in everyone
        if host != host0
    ]
    best, best_count = host0, -1
    for address in map(ipaddress.IPv4Interface, mine):
        # A host holding the very same address (docker's bridge, 172.17.0.1 everywhere) shares
        # no network.
        count = sum(
            any(address.ip in other.network and address.ip != other.ip for other in host)
            for host in others
        )
        if count > best_count:
            best, best_count = str(address.ip), count
    return best


def layout_line(env):
    """'4 rank(s) = 2 node(s) x 2 rank(s)/node', or, on nodes running different numbers of ranks,
    '4 rank(s) on 3 node(s) of 2, 1, 1 rank(s)'. Any object with a launch's fields will do."""
    per_node = nodes_of(getattr(env, "local_world_sizes", ()))
    if len(set(per_node)) > 1:
        return (
            f"{env.world_size} rank(s) on {len(per_node)} node(s) of "
            f"{', '.join(map(str, per_node))} rank(s)"
        )
    return (
        f"{env.world_size} rank(s) = {env.num_nodes} node(s) x {env.local_world_size} rank(s)/node"
    )


def nodes_of(local_world_sizes):
    """Ranks per node, largest first, from every rank's local world size: k ranks report k per
    node."""
    counts = {}
    for size in local_world_sizes:
        counts[size] = counts.get(size, 0) + 1
    return sorted(
        (size for size, ranks in counts.items() for _ in range(ranks // size)), reverse=True
    )


def host_key(hostname=None):
    """A number naming this host (its hostname), the same on every rank of it."""
    name = hostname or socket.gethostname()
    return int(hashlib.sha1(name.encode()).hexdigest()[:15], 16)


def local_rank_clash(ranks, variable):
    """ranks: every rank's (host key, the launcher's node id, local rank, ranks on its node),
    gathered alike on all ranks. A line if two ranks of one node claim the same local rank (both
    would take one GPU), or if a node runs another number of ranks than its ranks say; else None.
    variable: the launcher's local rank variable, to name in the line."""
    nodes = {}
    for rank, (host, node, local_rank, local_world) in enumerate(ranks):
        nodes.setdefault((host, node), []).append((rank, local_rank, local_world))
    for members in nodes.values():
        seen = {}
        for rank, local_rank, _ in members:
            if local_rank in seen:
                return (
                    f"ranks {seen[local_rank]} and {rank} both have {variable}={local_rank} on one "
                    "node: they would share its GPU and its share of cores; give each rank of a "
                    "node its own local rank (torchrun and srun do; set by hand, check them)"
                )
            seen[local_rank] = rank
        for rank, _, local_world in members:
            if local_world != len(members):
                return (
                    f"rank {rank} says its node runs {local_world} rank(s), but {len(members)} "
                    f"run there (ranks {', '.join(str(m[0]) for m in members)}): check the "
                    "launcher's ranks-per-node variables (LOCAL_WORLD_SIZE, "
                    "SLURM_STEP_TASKS_PER_NODE)"
                )
    return None


def check_shared_dir(directory, num_nodes):
    """Every host must see the same --checkpoint_dir (each rank writes its shards there, and all
    read them back). Rank 0 writes a file; after a barrier each rank looks for it; one gather of the
    verdicts: one line naming the hosts that cannot see it, on every rank."""
    if num_nodes <= 1:
        return
    directory = Path(directory)
    # rank 0's name for the file, and its error
    probe = [f".shared-check-{secrets.token_hex(8)}", None]
    if dist.get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / probe[0]).write_text(probe[0])
        except OSError as e:
            probe[1] = (
                f"--checkpoint_dir {directory}: rank 0 cannot write there ({e.strerror or e})"
            )
    dist.broadcast_object_list(probe, src=0)
    if probe[1]:
        raise ConfigError(probe[1])
    path = directory / probe[0]
    seen = _sees(path, probe[0])
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (socket.gethostname(), seen))
    if dist.get_rank() == 0:
        path.unlink(missing_ok=True)
    blind = blind_hosts(verdicts)
    if blind:
        raise ConfigError(
            f"--checkpoint_dir {directory} is not shared by every host: {blind} cannot see the "
            f"file rank 0 wrote there (on {verdicts[0][0]}), so a checkpoint would be split over "
            "node-local disks: put --checkpoint_dir on a file system every host mounts"
        )


def blind_hosts(verdicts):
    """verdicts: every rank's (hostname, whether it saw rank 0's file). The hosts that did not see
    it, by name; a name that ranks which did see it also carry (two hosts with one hostname) is told
    apart by its ranks."""
    blind = sorted({host for host, ok in verdicts if not ok})
    named = []
    for host in blind:
        if any(ok for other, ok in verdicts if other == host):
            ranks = [
                str(rank) for rank, (other, ok) in enumerate(verdicts) if other == host and not ok
            ]
            word = "rank" if len(ranks) == 1 else "ranks"
            named.append(f"{word} {', '.join(ranks)} on {host} (a hostname another host also has)")
        else:
            named.append(host)
    return ", ".join(named)


def _sees(path, text, seconds=5):
    """Whether `path` holds `text`, looked for a few seconds: a network file system may show a new
    file late."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return path.read_text() == text
        except OSError:
            if time.monotonic() > deadline:
                return False
            try:
                os.listdir(path.parent)  # a fresh listing of the directory, past cached attributes
            except OSError:
                return False  # not even the directory is there
            time.sleep(0.5)


@contextmanager
def gloo_quiet():
    """The C-level stdout goes to /dev/null while gloo connects a process group: torch 2.9's gloo
    prints a line there for each (pytorch/gloo#462; quiet in later torch), and stdout carries a
    sample's text alone."""
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
