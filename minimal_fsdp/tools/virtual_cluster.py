"""A cluster in a box: N hosts on one Linux machine, to rehearse a multi-node job before spending an
allocation (and for the multi-host tests, tests/test_multihost*.py).

A host is a network namespace with its own hostname, its own /etc/hosts and, if asked, a node-local
disk (a directory of its own bound over one path, e.g. the --checkpoint_dir, in each of its
processes). The hosts hang off one bridge through veth links that can be shaped (rate, delay, loss)
and cut; the bridge lives in a namespace of its own, so the machine's own network is never touched.
Built with pyroute2 (pure Python: no iproute2 needed, as on GPU machines that lack it); needs root.
Everything is torn down when the `with` block or the command ends, on failure and Ctrl-C too; the
namespaces of a cluster whose owner was killed are swept at the next start.

    minimal-fsdp cluster --hosts 2 -- bash pbs/train_multi_node.sh
    minimal-fsdp cluster --hosts 2 --rate 10gbit --delay 1ms -- \\
        mpiexec -n 4 -ppn 2 -hosts node0,node1 python basic_training.py --sharding hybrid-full-shard
    minimal-fsdp cluster --hosts 2 -- bash       # a shell on node0; `ssh node1 hostname`
    minimal-fsdp cluster --hosts 2 --scheduler slurm -- bash   # and a real SLURM (slurm_cluster.py)

The command runs its COMMAND on the first host, as a batch script runs on a job's first node, with
PBS_NODEFILE, a hostfile and a stand-in for ssh (first in PATH, and named to Hydra and Open MPI)
that enters the named host. See docs/launch.md, "Rehearse on virtual hosts".
"""

import contextlib
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from minimal_fsdp.tools.cluster_base import PACKAGE_PARENT, Started

NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")  # where `ip netns exec` finds a namespace's own /etc/hosts too
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# tbf's rate is a 32-bit count of bytes/s (pyroute2 sends no 64-bit rate): faster links stay
# unshaped.
TBF_MAX_BITS = 8 * (2**32 - 1)
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_clusters = itertools.count()


def bits_per_second(rate):
    """'10gbit', '500mbit' (tc's units) or a number of bits/s."""
    match = re.fullmatch(r"([\d.]+)\s*([a-z]*)", str(rate).lower())
    if not match or match[2] not in UNITS | {"": 1}:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 10gbit or 500mbit")
    return float(match[1]) * UNITS.get(match[2], 1)


def microseconds(delay):
    """'2ms', '500us', '0.1s' or a number of microseconds."""
    match = re.fullmatch(r"([\d.]+)\s*(us|ms|s|)", str(delay).lower())
    if not match:
        raise ValueError(f"delay {delay!r}: write it as tc does, e.g. 2ms or 500us")
    return int(float(match[1]) * {"us": 1, "": 1, "ms": 1e3, "s": 1e6}[match[2]])


def unavailable():
    """Why hosts cannot be made on this machine (a sentence), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "pyroute2 is not installed (pip install -e '.[cluster]')"
    probe = subprocess.run(
        [sys.executable, "-c", f"import ctypes; print(ctypes.CDLL(None).unshare({CLONE_NEWNET}))"],
        capture_output=True,
        text=True,
    )
    return None if probe.stdout.strip() == "0" else "this process may not create network namespaces"


def _libc(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _bind(source, target):
    _libc("mount", str(source).encode(), str(target).encode(), None, ctypes.c_ulong(MS_BIND), None)


@dataclass
class Host:
    name: str  # its hostname: node0, node1, ...
    netns: str  # its network namespace
    address: str  # on its link, eth0
    port: str  # its link's end on the bridge (in the switch namespace)
    interface: str = "eth0"


def enter(state, name):
    """Turn this (single-threaded) process into a process of host `name`: its network, hostname,
    /etc/hosts and node-local disk. The mount namespace is this process's own, so the binds vanish
    with it."""
    host = Host(**state["hosts"][name])
    with open(NETNS_DIR / host.netns) as f:
        _libc("setns", f.fileno(), CLONE_NEWNET)
    _libc("unshare", CLONE_NEWUTS | CLONE_NEWNS)
    # binds stay here
    _libc("mount", b"none", b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None)
    socket.sethostname(host.name)
    _bind(ETC_NETNS / host.netns / "hosts", "/etc/hosts")
    if state["node_local"]:
        disk = Path(state["dir"]) / "disks" / host.name
        disk.mkdir(parents=True, exist_ok=True)
        Path(state["node_local"]).mkdir(parents=True, exist_ok=True)
        _bind(disk, state["node_local"])


def _ipr(netns):
    from pyroute2 import NetNS

    return contextlib.closing(NetNS(netns))


class Cluster(Started):
    """`hosts` hosts named node0.. at 10.77.0.1.. (`subnet`), links shaped to `rate`/`delay`/`loss`.
    resolve: 'all' (every host resolves every name), 'none' (only localhost: hostnames do not
    resolve) or 'loopback' (a host's own name is 127.0.1.1, as Debian's installer writes it).
    node_local: a path that is a different directory on each host (a node-local disk)."""

    def __init__(
        self,
        hosts=2,
        rate=None,
        delay=None,
        loss=None,
        node_local=None,
        resolve="all",
        subnet="10.77.0",
        state_dir=None,
    ):
        tag = f"vc{os.getpid()}x{next(_clusters)}"
        self.switch = f"{tag}-sw"
        self.hosts = [
            Host(f"node{i}", f"{tag}-{i}", f"{subnet}.{i + 1}", f"{tag}p{i}") for i in range(hosts)
        ]
        self.shaping = dict(rate=rate, delay=delay, loss=loss)
        self.node_local, self.resolve = node_local and str(node_local), resolve
        self._own_dir = state_dir is None
        self.dir = Path(state_dir or tempfile.mkdtemp(prefix="virtual_cluster-"))
        self._procs = []
        self._owner = os.getpid()

    def host(self, name):
        return next(h for h in self.hosts if h.name == name)

    def up(self):
        from pyroute2 import netns

        sweep()
        # all before any NetNS socket is open
        for name in (self.switch, *(h.netns for h in self.hosts)):
            netns.create(name)
        with _ipr(self.switch) as sw:
            sw.link("add", ifname="br0", kind="bridge")
            bridge = sw.link_lookup(ifname="br0")[0]
            sw.link("set", index=bridge, state="up")
            for host in self.hosts:
                sw.link(
                    "add",
                    ifname=host.port,
                    kind="veth",
                    peer={"ifname": host.interface, "net_ns_fd": host.netns},
                )
                sw.link("set", index=sw.link_lookup(ifname=host.port)[0], master=bridge, state="up")
        for host in self.hosts:  # one NetNS socket open at a time: pyroute2 mixes them up otherwise
            with _ipr(host.netns) as ipr:
                link = ipr.link_lookup(ifname=host.interface)[0]
                ipr.addr("add", index=link, address=host.address, prefixlen=24)
                ipr.link("set", index=link, state="up")
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            self.shape(host.name, **self.shaping)
            self._write_hosts_file(host)
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {
            "dir": str(self.dir),
            "node_local": self.node_local,
            "hosts": {h.name: asdict(h) for h in self.hosts},
        }
        (self.dir / "cluster.json").write_text(json.dumps(state))
        self._write_ssh()

    def _write_hosts_file(self, host):
        # c10d's store sees its clients at IPv4-mapped addresses (a client on its own host at
        # ::ffff:127.0.0.1) and names each one: with no entry, the lookup goes to a DNS server no
        # namespace reaches (a warning per client)
        lines = ["127.0.0.1 localhost", "::1 localhost", "::ffff:127.0.0.1 localhost"]
        if self.resolve == "all":
            lines += [f"{h.address} {h.name}" for h in self.hosts]
            lines += [f"::ffff:{h.address} {h.name}" for h in self.hosts]
        elif self.resolve == "loopback":
            lines.append(f"127.0.1.1 {host.name}")
        (ETC_NETNS / host.netns).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / host.netns / "hosts").write_text("\n".join(lines) + "\n")

    def _write_ssh(self):
        """bin/ssh: `ssh [options] HOST COMMAND...` runs COMMAND through a shell on HOST, as ssh
        does."""
        (self.dir / "bin").mkdir(exist_ok=True)
        self.ssh = self.dir / "bin" / "ssh"
        self.ssh.write_text(
            "#!/bin/sh\n# ssh to a virtual host (minimal_fsdp.tools.virtual_cluster): options "
            "skipped, command run by sh\n"
            'while [ $# -gt 0 ]; do case "$1" in -[bcDEeFIiJLlmOopQRSWw]) shift 2;; -*) shift;; *) '
            'break;; esac; done\n'
            'host=$1; shift\n'
            f'PYTHONPATH="{PACKAGE_PARENT}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" '
            f'-m minimal_fsdp.tools.virtual_cluster exec --state "{self.dir}" "$host" -- sh -c '
            f'"$*"\n'
        )
        self.ssh.chmod(0o755)

    def nodefile(self, slots=1):
        """A PBS_NODEFILE / hostfile: each host's name `slots` times."""
        path = self.dir / "nodefile"
        path.write_text("".join(f"{h.name}\n" * slots for h in self.hosts))
        return path

    def job_env(self, slots=1):
        """What a batch script sees on the first node: the node list, and ssh that reaches the other
        hosts."""
        nodefile = self.nodefile(slots)
        return {
            "PBS_NODEFILE": str(nodefile),
            "PBS_JOBID": f"{self.switch}.virtual",
            "HOSTFILE": str(nodefile),
            "PATH": f"{self.ssh.parent}:{os.environ.get('PATH', '')}",
            "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": str(self.ssh),
            "OMPI_MCA_plm_rsh_agent": str(self.ssh),
        }

    def command(self, name, argv):
        """argv as run on host `name`."""
        return [
            sys.executable,
            "-m",
            "minimal_fsdp.tools.virtual_cluster",
            "exec",
            "--state",
            str(self.dir),
            name,
            "--",
            *map(str, argv),
        ]

    def run(self, name, argv, env=None, **popen):
        """Start argv on host `name` (a process group of its own, killed at teardown); returns the
        Popen."""
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = PACKAGE_PARENT + (
            ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        proc = subprocess.Popen(self.command(name, argv), env=env, start_new_session=True, **popen)
        self._procs.append(proc)
        return proc

    def shape(self, name, rate=None, delay=None, loss=None):
        """Shape host `name`'s outgoing link: netem for delay and loss, tbf for the rate (under
        netem where both). Replaces what was there (a second root qdisc cannot be added)."""
        from pyroute2.netlink.exceptions import NetlinkError

        host = self.host(name)
        rate = rate and bits_per_second(rate)
        with _ipr(host.netns) as ipr:
            link = ipr.link_lookup(ifname=host.interface)[0]
            with contextlib.suppress(NetlinkError):  # nothing there yet
                ipr.tc("del", index=link, handle="1:", parent=0xFFFFFFFF)
            parent = {}
            if delay or loss:
                try:
                    ipr.tc(
                        "add",
                        kind="netem",
                        index=link,
                        handle="1:",
                        delay=microseconds(delay or 0),
                        loss=float(loss or 0),
                        limit=100_000,
                    )
                except NetlinkError as e:
                    raise ValueError(
                        f"delay and loss need the kernel's netem qdisc (sch_netem), which this "
                        f"machine lacks ({e}); the rate alone (tbf) works without it"
                    ) from None
                parent = {"parent": "1:1"}
            if rate and rate <= TBF_MAX_BITS:
                # A burst of 1 ms at the rate (at least 256 KB: veth sends 64 KB segments); packets
                # wait <= 50 ms.
                burst = max(1 << 18, int(rate / 8 / 1000))
                ipr.tc(
                    "add",
                    kind="tbf",
                    index=link,
                    handle="10:" if parent else "1:",
                    rate=f"{int(rate)}bit",
                    burst=burst,
                    latency="50ms",
                    **parent,
                )

    def cut(self, name, up=False):
        """Take host `name`'s link down at the bridge (as a pulled cable), or back up."""
        with _ipr(self.switch) as sw:
            sw.link(
                "set",
                index=sw.link_lookup(ifname=self.host(name).port)[0],
                state="up" if up else "down",
            )

    def bytes_moved(self, name):
        """Bytes host `name`'s link has carried both ways so far (counted at the bridge)."""
        with _ipr(self.switch) as sw:
            stats = sw.get_links(sw.link_lookup(ifname=self.host(name).port)[0])[0].get(
                "IFLA_STATS64"
            )
        return stats["rx_bytes"] + stats["tx_bytes"]

    def throughput(self, sender, receiver, megabytes=32):
        """Gbit/s of one TCP stream from host `sender` to host `receiver` (first byte to last)."""
        port = 5201
        server = self.run(
            receiver,
            [sys.executable, "-c", _RECEIVER, str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        client = self.run(
            sender,
            [sys.executable, "-c", _SENDER, self.host(receiver).address, str(port), str(megabytes)],
        )
        client.wait(timeout=120)
        received, seconds = map(float, server.communicate(timeout=120)[0].split())
        return received * 8 / seconds / 1e9

    def down(self):
        """Kill what runs on the hosts, remove the namespaces and files. Safe to call twice."""
        # a forked child (pyroute2 forks) unwinding: not its cluster to remove
        if os.getpid() != self._owner:
            return
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        self._procs = []
        _remove([self.switch, *(h.netns for h in self.hosts)])
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


_RECEIVER = """import socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1]))); c, _ = s.accept()
n = len(c.recv(1 << 20)); t = time.perf_counter()
while True:
    k = len(c.recv(1 << 20))
    if not k: break
    n += k
print(n, time.perf_counter() - t)"""
_SENDER = """import socket, sys, time
for _ in range(100):
    try: c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
block = bytes(1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(block)
c.close()"""


def _remove(names):
    """Kill every process inside these namespaces, then remove them and their /etc/netns files."""
    from pyroute2 import netns

    inodes = {}
    for name in names:
        with contextlib.suppress(OSError):
            inodes[os.stat(NETNS_DIR / name).st_ino] = name
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
    for name in names:
        with contextlib.suppress(OSError):
            netns.remove(name)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def sweep():
    """Remove the namespaces of clusters whose owning process is gone (killed before it could tear
    down)."""
    from pyroute2 import netns

    stale = []
    for name in netns.listnetns():
        match = re.fullmatch(r"vc(\d+)x\d+-\w+", name)
        if match and not Path(f"/proc/{match[1]}").exists():
            stale.append(name)
    _remove(stale)


def rehearse(args, command):
    """`minimal-fsdp cluster`: the hosts its flags (ClusterFlags) ask for, `command` run on the
    first, then torn down; returns the command's exit code."""
    why = unavailable()
    if why:
        sys.exit(f"error: cannot make virtual hosts here: {why}")
    if args.scheduler == "slurm":
        from minimal_fsdp.tools import slurm_cluster

        why = slurm_cluster.unavailable()
        if why:
            sys.exit(f"error: --scheduler slurm: {why}")
    owner = os.getpid()
    # unwind through the teardown below (only in this process)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(
            signum, lambda signum, _: (sys.exit if os.getpid() == owner else os._exit)(128 + signum)
        )
    try:
        cluster = Cluster(
            args.hosts, args.rate, args.delay, args.loss, args.node_local, args.resolve
        ).__enter__()
    except ValueError as e:  # shaping this kernel cannot do (torn down already)
        sys.exit(f"error: {e}")
    try:
        names = ", ".join(f"{h.name} {h.address}" for h in cluster.hosts)
        env = dict(os.environ, PBS_O_WORKDIR=os.getcwd(), **cluster.job_env(args.slots))
        if args.scheduler == "slurm":
            try:
                slurm = slurm_cluster.Slurm(cluster).__enter__()
            except slurm_cluster.SlurmError as e:
                print(e.logs, file=sys.stderr)
                sys.exit(f"error: --scheduler slurm: {e}")
            names += f"; SLURM: partition virtual, SLURM_CONF={slurm.conf}"
            # a SLURM job, not a PBS one: sbatch and srun say where the nodes are
            env = {k: v for k, v in slurm.env(env).items() if not k.startswith("PBS_")}
        print(
            f"virtual cluster: {names}; running on {cluster.hosts[0].name}: {' '.join(command)}",
            flush=True,
        )
        proc = cluster.run(cluster.hosts[0].name, command, env=env, stdout=subprocess.PIPE)
        try:
            seen = Rehearsal.watch(proc.stdout)
            code = proc.wait()
        except KeyboardInterrupt:
            code, seen = 130, None
        if seen is not None:
            code = seen.report(cluster, code)
    finally:
        cluster.down()
    return code


class Rehearsal:
    """What a job run on the hosts printed that says what it proved: the training run's launch line
    (ranks, nodes), the network it picked and how far it trained. The job's output passes through
    unchanged."""

    # bytes across the hosts' links below which no training collective crossed them
    TALKED = 100_000

    def __init__(self):
        self.launch = self.network = self.done = None

    @classmethod
    def watch(cls, stream):
        seen = cls()
        for raw in iter(stream.readline, b""):
            sys.stdout.buffer.write(raw)
            sys.stdout.flush()
            line = raw.decode(errors="replace").strip()
            for key, prefix in (
                ("launch", "launch: "),
                ("network", "network: "),
                ("done", "done: "),
            ):
                if line.startswith(prefix):
                    setattr(seen, key, line[len(prefix) :])
        return seen

    def report(self, cluster, code):
        """Print what the job proved across the hosts (nothing for a command that trained no run);
        the exit code: the job's, or 1 where it exited 0 but trained nothing across the hosts."""
        if self.launch is None:
            return code
        moved = sum(cluster.bytes_moved(h.name) for h in cluster.hosts[1:])
        hosts = f"{len(cluster.hosts)} hosts ({', '.join(h.name for h in cluster.hosts)})"
        ranks = self.launch.split(", started by")[0]
        trained = re.search(r"this launch trained (\d+) steps", self.done or "")
        problems = []
        if moved < self.TALKED:
            problems.append(
                f"only {moved:,} bytes crossed the links: no training collective crossed the hosts"
            )
        if trained and trained[1] == "0":
            problems.append(
                "this launch trained 0 steps (it resumed a finished run: give the rehearsal its "
                "own --run_name)"
            )
        if code or problems:
            why = "; ".join(problems) or f"the job exited {code}"
            print(f"rehearsal: proved nothing across {hosts}: {why}", flush=True)
            return code or 1
        network = self.network.split(",")[0] if self.network else "the interface gloo found itself"
        print(
            f"rehearsal: trained across {hosts}: {ranks}; network {network}; {moved / 1e6:.1f} MB "
            f"crossed the links between the hosts; {trained[1] if trained else 'its'} steps "
            f"trained",
            flush=True,
        )
        return code


def exec_on_host(argv):
    """The ssh stand-in's `exec --state DIR HOST -- COMMAND...` (written by Cluster, never typed):
    COMMAND run inside HOST's namespaces."""
    if len(argv) < 6 or argv[:2] != ["exec", "--state"] or argv[4] != "--":
        sys.exit(
            "usage: python -m minimal_fsdp.tools.virtual_cluster exec --state DIR HOST -- COMMAND "
            "..."
        )
    state_dir, host, command = argv[2], argv[3], argv[5:]
    state = json.loads((Path(state_dir) / "cluster.json").read_text())
    if host not in state["hosts"]:
        sys.exit(f"ssh: Could not resolve hostname {host}: not a host of this virtual cluster")
    enter(state, host)
    os.execvp(command[0], command)


if __name__ == "__main__":  # only the ssh stand-in's entry; people run `minimal-fsdp cluster`
    exec_on_host(sys.argv[1:])
