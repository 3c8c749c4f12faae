"""A real SLURM on the virtual hosts (`minimal-fsdp cluster --scheduler slurm`): munge, slurmctld on
the first host and a slurmd on each, from the distribution's own packages (Debian's slurm-wlm 22.05,
`apt-get install slurm-wlm munge`), so that sbatch, srun, squeue and scancel behave as on a cluster:
our slurm/ scripts meet SLURM's own signals, requeues, dependencies and node failures.

Everything lives in one state folder: a munge key and socket of its own (the machine's munged, if
any, is not used), slurm.conf (SLURM_CONF, which every client command reads), each daemon's spool,
PID and log file (%n: each slurmd's node name, since the daemons share one file system). The daemons
run in the foreground (-D) as processes of the hosts, so the cluster's teardown kills them with
everything else on the hosts.

The configuration is the least that works in network namespaces without cgroups (a container's
usual lot): processes tracked through /proc (proctrack/linuxproc), no task plugin (task/none: no
binding, no cgroups), no accounting database, nodes as the config says whatever the kernel counts
(SlurmdParameters=config_overrides: the hosts share this machine's cores; 32 CPUs a node, so the
default job script's 4 tasks x 8 CPUs fit; no GPUs: --gpus-per-node=0), nodes back in service by
themselves when their slurmd returns (ReturnToService=2), and short timeouts so a lost node ends its
job in seconds, not minutes.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from minimal_fsdp.tools.cluster_base import PACKAGE_PARENT, Started

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
SBIN = ("/usr/sbin", "/sbin")


def which(name):
    """A SLURM or munge program, from PATH or sbin (a user's PATH often lacks /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN)
    return shutil.which(name, path=path)


def unavailable():
    """Why a SLURM cluster cannot be made here (a sentence), or None."""
    missing = [name for name in DAEMONS + CLIENTS if which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: install SLURM and munge (Debian/Ubuntu: apt-get "
            "install slurm-wlm munge)"
        )
    return None


def slurm_conf(state, hosts, cpus, munge_socket, slurmd_timeout=10, kill_wait=10):
    """slurm.conf for these hosts (Host objects), `cpus` CPUs each, everything under `state`."""
    nodes = f"node[0-{len(hosts) - 1}]" if len(hosts) > 1 else hosts[0].name
    addresses = ",".join(h.address for h in hosts)
    return f"""# written by minimal_fsdp.tools.slurm_cluster for virtual hosts
ClusterName=virtual
SlurmctldHost={hosts[0].name}({hosts[0].address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits this long (the old job's credentials expiring) before it may start again;
# the default is 120 s
AuthInfo=socket={munge_socket},cred_expire=20
StateSaveLocation={state}/slurmctld
SlurmdSpoolDir={state}/slurmd/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups in a namespace: processes tracked through /proc, no binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# the hosts share this machine's cores: trust the config, not what slurmd counts
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
KillWait={kill_wait}
MessageTimeout=10
MinJobAge=600
InactiveLimit=0
SchedulerType=sched/backfill
NodeName={nodes} NodeAddr={addresses} CPUs={cpus} State=UNKNOWN
PartitionName=virtual Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmError(RuntimeError):
    """The daemons did not come up: the line, and the tail of their logs (gone with the state
    folder at teardown)."""

    def __init__(self, line, logs):
        super().__init__(line)
        self.logs = logs


class Slurm(Started):
    """SLURM's daemons on a started Cluster (virtual_cluster.Cluster); `with` starts them and waits
    for every node to be idle, and leaving stops them (the cluster's own teardown kills whatever is
    left)."""

    def __init__(self, cluster, cpus=32, slurmd_timeout=10, kill_wait=10):
        self.cluster, self.cpus = cluster, cpus
        self.dir = Path(cluster.dir) / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.timeouts = dict(slurmd_timeout=slurmd_timeout, kill_wait=kill_wait)
        self.daemons = {}  # name -> Popen

    def env(self, base=None):
        """The environment SLURM's commands need: SLURM_CONF, and sbin in PATH for the daemons."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def up(self):
        for sub in ("munge", "slurmctld", "slurmd", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket folder others cannot enter, and a key others can read
        os.chmod(self.dir, 0o755)
        os.chmod(self.dir / "munge", 0o755)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(
            slurm_conf(self.dir, self.cluster.hosts, self.cpus, self.munge_socket, **self.timeouts)
        )
        first = self.cluster.hosts[0].name
        munge = self.dir / "munge"
        self._start(
            "munged",
            first,
            [
                which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={self.dir / 'log' / 'munged.log'}",
            ],
        )
        self._wait(self.munge_socket.exists, "munged to create its socket", "munged")
        self._start("slurmctld", first, [which("slurmctld"), "-D", "-i", "-f", self.conf])
        self._wait(
            lambda: self._ask(["scontrol", "ping"], "UP"), "slurmctld to answer", "slurmctld"
        )
        for host in self.cluster.hosts:
            self.start_node(host.name)
        self.wait_idle()

    def _start(self, name, host, argv):
        log = open(self.dir / "log" / f"{name}.out", "ab")
        self.daemons[name] = self.cluster.run(
            host, argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def start_node(self, name):
        """Start host `name`'s slurmd (again, after kill_node)."""
        self._start(f"slurmd-{name}", name, [which("slurmd"), "-D", "-N", name, "-f", self.conf])

    def kill_node(self, name):
        """Kill everything on host `name` at once (slurmd, its job steps, their tasks), as a node
        that loses power."""
        self.daemons.pop(f"slurmd-{name}", None)
        with open(f"/var/run/netns/{self.cluster.host(name).netns}") as f:
            inode = os.fstat(f.fileno()).st_ino
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}/ns/net").st_ino == inode:
                    os.kill(int(pid), signal.SIGKILL)

    def wait_idle(self, timeout=60):
        """Wait until every node is idle (its slurmd registered and no job on it)."""
        count = len(self.cluster.hosts)
        self._wait(
            lambda: (
                self._ask(["sinfo", "-h", "-N", "-o", "%t"], None).split().count("idle") == count
            ),
            f"all {count} slurmd to register",
            "slurmd",
            timeout,
        )

    def _ask(self, argv, expect):
        """A client command's output, run on the first host (slurmctld's address is reachable from
        the hosts only), or '' on failure; with `expect`, whether it printed that."""
        result = self.client(argv, capture_output=True, text=True, timeout=30)
        out = result.stdout if result.returncode == 0 else ""
        return expect in out if expect is not None else out

    def client(self, argv, host=None, **run):
        """subprocess.run of a SLURM command (sbatch, squeue, ...) on host `host` (the first)."""
        command = self.cluster.command(
            host or self.cluster.hosts[0].name, [which(argv[0]), *argv[1:]]
        )
        env = self.env(run.pop("env", None))
        env["PYTHONPATH"] = PACKAGE_PARENT
        return subprocess.run(command, env=env, **run)

    def _wait(self, ready, what, daemon, timeout=60):
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"waited {timeout} s"
                raise SlurmError(f"SLURM did not start: {why} waiting for {what}", self.logs())
            time.sleep(0.3)

    def logs(self, lines=15):
        """The last lines of each daemon's log, for an error message."""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def down(self):
        for proc in reversed(list(self.daemons.values())):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self.daemons = {}
