"""A stand-in PBS Pro server that follows ALCF's documented Polaris behaviour, for the job chain
tests (no PBS server is packaged for these machines). `install(bin_dir, state_dir)` puts `qsub` and
`qstat` first on PATH; `Server(state_dir)` runs the queued jobs one at a time, as the scheduler
would, and can preempt or end one at a point the test chooses.

What it enforces (docs.alcf.anl.gov, Polaris "Running Jobs", read 2026-11-29; QUEUES below):
- `prod` is a routing queue: a job goes to the execution queue its node count falls in (small
  10-24 nodes up to 3 h, medium 25-99 up to 6 h, large 100-496 up to 24 h). Those cannot be
  submitted to directly; a job no execution queue takes is rejected. `qstat -f` names the
  execution queue, PBS_O_QUEUE the queue asked for.
- every queue's node and walltime range (5 min at least), checked at submission;
- `-v NAME=value,...` (a value in quotes may hold commas, as PBS Pro allows) and `-v NAME`, whose
  value comes from qsub's own environment, whatever characters it holds; `-V`;
- `-W depend=afterany:ID[:ID...]`: the job waits until those have ended;
- `-r y|n` (and `#PBS -r`): a preempted rerunnable job is requeued under the same id and runs again;
- preemption without warning (SIGKILL to every process of the job), preemption and the walltime's
  end with SIGTERM first and SIGKILL after KILL_DELAY seconds;
- the script's `#PBS` lines, overridden by the command line's; the job starts in $HOME, and its
  output (-j oe) lands in PBS_O_WORKDIR as NAME.oSEQ when it ends.
Every node of a job is this machine: PBS_NODEFILE names this host once per node asked for.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fake_launchers import session_processes

HOUR = 3600


@dataclass(frozen=True)
class Queue:
    nodes: tuple  # (min, max)
    walltime: tuple  # (min, max) seconds
    routes_to: tuple = ()  # a routing queue's execution queues, tried in order
    from_route_only: bool = False  # reached only through a routing queue


# Polaris' queues as ALCF documents them. backfill-small/medium/large (prod's destinations for a
# project with a negative balance) are left out: same limits as small/medium/large.
QUEUES = {
    "debug": Queue((1, 2), (300, HOUR)),
    "debug-scaling": Queue((1, 10), (300, HOUR)),
    "preemptable": Queue((1, 10), (300, 72 * HOUR)),
    "demand": Queue((1, 56), (300, HOUR)),
    "capacity": Queue((1, 4), (300, 168 * HOUR)),
    "prod": Queue((10, 496), (300, 24 * HOUR), routes_to=("small", "medium", "large")),
    "small": Queue((10, 24), (300, 3 * HOUR), from_route_only=True),
    "medium": Queue((25, 99), (300, 6 * HOUR), from_route_only=True),
    "large": Queue((100, 496), (300, 24 * HOUR), from_route_only=True),
}
DEFAULT_QUEUE = "prod"
# PBS Pro's default kill_delay is 10 s; the tests' is long enough for any save under load, so that
# nothing depends on timing (a site's value: qstat -Qf QUEUE | grep kill_delay).
KILL_DELAY = 300
SERVER = "fake-pbs"
# qsub adds these from its own environment, prefixed PBS_O_ (POSIX qsub)
QSUB_ENV = ("HOME", "LANG", "LOGNAME", "PATH", "MAIL", "SHELL", "TZ")


def seconds(text):
    total = 0
    for part in text.split(":"):
        total = total * 60 + int(part)
    return total


def hms(total):
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


class Refused(Exception):
    pass


def split_variables(text):
    """qsub -v's list: commas separate, except inside a quoted value ('...' or "...")."""
    items, current, quote = [], "", None
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
            else:
                current += ch
        elif ch in "'\"":
            quote = ch
        elif ch == ",":
            items.append(current)
            current = ""
        else:
            current += ch
    if quote:
        raise Refused("qsub: illegal -v value (an unterminated quote)")
    return [item for item in items + [current] if item]


def node_count(select):
    """select=2:system=polaris or 1:ncpus=64+2:ngpus=4 -> nodes (chunks)."""
    total = 0
    for chunk in select.split("+"):
        count = chunk.split(":", 1)[0]
        total += int(count) if count.isdigit() else 1
    return total


def directives(script):
    """The options of the script's #PBS lines, in order (read up to the first command)."""
    options = []
    for line in Path(script).read_text().splitlines():
        if line.startswith("#PBS"):
            options += line[4:].split("#", 1)[0].split()
        elif line.strip() and not line.startswith("#"):
            break
    return options


def parse_options(argv, job, environ):
    args = list(argv)
    while args:
        option = args.pop(0)
        if not option.startswith("-"):
            return [option, *args]
        if option in ("-V",):
            job["variables"].update(environ)
            continue
        if option == "-I":
            raise Refused("qsub: interactive jobs are not part of this stand-in")
        if not args:
            raise Refused(f"qsub: option {option} needs a value")
        value = args.pop(0)
        if option == "-A":
            job["account"] = value
        elif option == "-q":
            job["queue"] = value
        elif option == "-N":
            job["name"] = value
        elif option == "-r":
            if value not in ("y", "n"):
                raise Refused(f"qsub: illegal -r value {value!r}")
            job["rerunnable"] = value == "y"
        elif option == "-l":
            for item in value.split(","):
                name, _, res = item.partition("=")
                job["resources"][name] = res
        elif option == "-v":
            for item in split_variables(value):
                name, eq, val = item.partition("=")
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                    raise Refused(f"qsub: illegal -v variable name {name!r}")
                if eq:
                    job["variables"][name] = val
                elif name in environ:
                    job["variables"][name] = environ[name]
        elif option == "-W":
            kind, _, rest = value.partition("=")
            if kind != "depend":
                continue
            dep_type, _, ids = rest.partition(":")
            if dep_type != "afterany":
                raise Refused(f"qsub: this stand-in knows afterany only, not {dep_type}")
            job["depend"] += ids.split(":")
        elif option in ("-j", "-o", "-e", "-m", "-M", "-k", "-p"):
            job.setdefault("other", {})[option] = value
        else:
            raise Refused(f"qsub: invalid option -- '{option}'")
    return []


def route(job):
    """The execution queue of the job, or Refused as PBS refuses it."""
    name = job["queue"]
    queue = QUEUES.get(name)
    if queue is None:
        raise Refused(f"qsub: Unknown queue {name}")
    if queue.from_route_only:
        raise Refused(
            f"qsub: Access to queue is denied ({name} takes jobs from the routing queue prod only)"
        )
    nodes = node_count(job["resources"].get("select", "1"))
    walltime = seconds(job["resources"].get("walltime", "01:00:00"))

    def fits(q):
        return q.nodes[0] <= nodes <= q.nodes[1] and q.walltime[0] <= walltime <= q.walltime[1]

    if queue.routes_to:
        for destination in queue.routes_to:
            if fits(QUEUES[destination]):
                return destination
        raise Refused(
            f"qsub: Job rejected by all possible destinations (prod: {nodes} node(s) for "
            f"{hms(walltime)})"
        )
    if not fits(queue):
        raise Refused(
            f"qsub: Job violates queue and/or server resource limits ({name}: {nodes} node(s) for "
            f"{hms(walltime)})"
        )
    return name


class State:
    """The jobs, one JSON file each in a directory (qsub and qstat are separate processes)."""

    def __init__(self, root):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def jobs(self):
        return [json.loads(p.read_text()) for p in sorted(self.root.glob("*.json"))]

    def get(self, job_id):
        path = self.root / f"{job_id.split('.')[0]}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, job):
        path = self.root / f"{job['seq']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(job, indent=1))
        tmp.replace(path)


def submit(argv, environ, cwd, state):
    """qsub: returns the job id, or raises Refused."""
    job = {
        "name": None,
        "account": None,
        "queue": None,
        "resources": {},
        "variables": {},
        "depend": [],
        "rerunnable": True,  # PBS Pro's default: y
        "argv": list(argv),
    }
    # The command line wins over the #PBS lines: read the script's first, then the command line's.
    command = dict(job, resources={}, variables={}, depend=[])
    positional = parse_options(argv, command, environ)
    if len(positional) != 1:
        raise Refused("qsub: one job script expected (this stand-in takes no `-- command`)")
    script = Path(cwd, positional[0])
    if not script.is_file():
        raise Refused(f"qsub: script file:: No such file or directory ({positional[0]})")
    parse_options(directives(script), job, environ)
    for key in ("name", "account", "queue"):
        if command[key] is not None:
            job[key] = command[key]
    job["resources"].update(command["resources"])
    job["variables"].update(command["variables"])
    job["depend"] += command["depend"]
    if "-r" in argv:
        job["rerunnable"] = command["rerunnable"]
    job["queue"] = job["queue"] or DEFAULT_QUEUE
    job["name"] = job["name"] or script.name
    job["exec_queue"] = route(job)
    seq = max((j["seq"] for j in state.jobs()), default=0) + 1
    job_id = f"{seq}.{SERVER}"
    for dep in job["depend"]:
        if state.get(dep) is None:
            raise Refused(f"qsub: Unknown Job Id {dep} (in -W depend)")
    variables = {f"PBS_O_{name}": environ[name] for name in QSUB_ENV if name in environ}
    variables.update(
        PBS_O_WORKDIR=str(cwd),
        PBS_O_HOST=socket.gethostname(),
        PBS_O_SYSTEM="Linux",
        PBS_O_QUEUE=job["queue"],
    )
    job["variables"] = {**variables, **job["variables"]}
    job.update(
        id=job_id, seq=seq, script=str(script.resolve()), state="Q", runs=0, exit_status=None
    )
    state.put(job)
    return job_id


def qstat_text(job):
    """qstat -f JOBID, PBS Pro's text layout (commas inside Variable_List values escaped)."""
    lines = [
        f"Job Id: {job['id']}",
        f"    Job_Name = {job['name']}",
        f"    job_state = {job['state']}",
        f"    queue = {job['exec_queue']}",
        f"    Account_Name = {job['account']}",
    ]
    lines += [f"    Resource_List.{k} = {v}" for k, v in sorted(job["resources"].items())]
    lines.append(f"    Rerunable = {job['rerunnable']}")
    variables = ",".join(
        f"{k}={v.replace(',', chr(92) + ',')}" for k, v in job["variables"].items()
    )
    lines.append(f"    Variable_List = {variables}")
    return "\n".join(lines)


def qstat_json(job):
    """qstat -f -F json JOBID."""
    return json.dumps(
        {
            "pbs_version": "2022.1.1 (stand-in)",
            "pbs_server": SERVER,
            "Jobs": {
                job["id"]: {
                    "Job_Name": job["name"],
                    "job_state": job["state"],
                    "queue": job["exec_queue"],
                    "Account_Name": job["account"],
                    "Resource_List": dict(sorted(job["resources"].items())),
                    "Rerunable": str(job["rerunnable"]),
                    "Variable_List": job["variables"],
                    "run_count": job["runs"],
                }
            },
        },
        indent=4,
    )


def qsub_main():
    state = State(os.environ["FAKE_PBS_DIR"])
    try:
        print(submit(sys.argv[1:], dict(os.environ), os.getcwd(), state))
    except Refused as e:
        print(e, file=sys.stderr)
        sys.exit(1)


def qstat_main():
    state = State(os.environ["FAKE_PBS_DIR"])
    args = sys.argv[1:]
    as_json = "-F" in args and args[args.index("-F") + 1] == "json"
    ids = [a for a in args if a[0].isdigit()]
    if "-f" not in args or len(ids) != 1:
        print("qstat (stand-in): only `qstat -f [-F json] JOBID`", file=sys.stderr)
        sys.exit(2)
    job = state.get(ids[0])
    if job is None or job["state"] == "F":
        print(f"qstat: Unknown Job Id {ids[0]}", file=sys.stderr)
        sys.exit(153)
    print(qstat_json(job) if as_json else qstat_text(job))


def install(bin_dir, state_dir):
    """Writes qsub and qstat into bin_dir; returns the environment that puts them first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    for name in ("qsub", "qstat"):
        (bin_dir / name).write_text(
            f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(here)!r})\n"
            f"from fake_pbs import {name}_main\n{name}_main()\n"
        )
        (bin_dir / name).chmod(0o755)
    State(state_dir)
    return {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FAKE_PBS_DIR": str(state_dir),
    }


@dataclass
class Run:
    job_id: str
    returncode: int  # the script's exit status; 271 = killed by the scheduler (256 + SIGTERM's 15)
    output: str
    requeued: bool


class Server:
    """Runs the queued jobs, in order, each in a session of its own (as a MoM does), with the
    environment the job gets from PBS: the test's base environment (the login environment), the
    job's Variable_List and PBS's own job variables."""

    def __init__(self, state_dir, base_env, home):
        self.state = State(state_dir)
        self.base_env = base_env
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)

    def next_job(self):
        done = {j["id"] for j in self.state.jobs() if j["state"] == "F"}
        return next(
            (
                j
                for j in self.state.jobs()
                if j["state"] == "Q" and all(d in done for d in j["depend"])
            ),
            None,
        )

    def run(self, job, interrupt=None, timeout=300):
        """Runs `job` to its end. interrupt: (condition, how[, after]): condition() is polled while
        the job runs; once true the job gets `how`, and after() is called. how: "preempt-kill"
        (SIGKILL without warning), "preempt-term" (SIGTERM, SIGKILL after KILL_DELAY) or
        "walltime" (the same). A preempted rerunnable job goes back to the queue under its id; the
        others end."""
        job["state"], job["runs"] = "R", job["runs"] + 1
        self.state.put(job)
        nodefile = self.home / f"nodefile.{job['seq']}"
        nodes = node_count(job["resources"].get("select", "1"))
        nodefile.write_text(f"{socket.gethostname()}\n" * nodes)
        env = dict(
            self.base_env,
            **job["variables"],
            HOME=str(self.home),
            PBS_JOBID=job["id"],
            PBS_JOBNAME=job["name"],
            PBS_QUEUE=job["exec_queue"],
            PBS_NODEFILE=str(nodefile),
            PBS_ENVIRONMENT="PBS_BATCH",
            PBS_JOBDIR=str(self.home),
        )
        process = subprocess.Popen(
            ["bash", job["script"]],
            env=env,
            cwd=self.home,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        chunks = []
        reader = _Reader(process.stdout, chunks)
        how, deadline = None, time.monotonic() + timeout
        try:
            while process.poll() is None:
                if interrupt and how is None and interrupt[0]():
                    how = interrupt[1]
                    self._signal(process.pid, signal.SIGKILL if how == "preempt-kill" else 15)
                    if len(interrupt) > 2:
                        interrupt[2]()  # e.g. let the job's ranks go on, once signalled
                    if how != "preempt-kill":
                        self._await(process, KILL_DELAY)
                        self._signal(process.pid, signal.SIGKILL)
                assert time.monotonic() < deadline, "the job does not end"
                time.sleep(0.1)
            # a job's processes end with it (a moment for mpiexec's to be reaped); the MoM would
            # kill what is left, and the test fails
            linger = time.monotonic() + 30
            while session_processes(process.pid) and time.monotonic() < linger:
                time.sleep(0.2)
            leftover = [] if how == "preempt-kill" else session_processes(process.pid)
        finally:
            self._signal(process.pid, signal.SIGKILL)
            process.wait()
            reader.join()
        output = "".join(chunks)
        killed = how is not None and process.returncode != 0
        code = 256 + 15 if killed and how != "preempt-kill" else process.returncode
        if how == "preempt-kill":
            code = 256 + 9
        requeued = how in ("preempt-kill", "preempt-term") and job["rerunnable"]
        job["state"] = "Q" if requeued else "F"
        job["exit_status"] = code
        self.state.put(job)
        workdir = Path(job["variables"]["PBS_O_WORKDIR"])
        with open(workdir / f"{job['name']}.o{job['seq']}", "a") as f:
            f.write(output)
        assert not leftover, f"processes left behind by job {job['id']}: {leftover}"
        return Run(job["id"], code, output, requeued)

    def drain(self, interrupts=(), max_runs=8):
        """Runs jobs until none is eligible; interrupts[i] (or None) applies to the i-th run.
        Returns the runs."""
        runs = []
        while (job := self.next_job()) is not None:
            assert len(runs) < max_runs, "the chain does not end"
            interrupt = interrupts[len(runs)] if len(runs) < len(interrupts) else None
            runs.append(self.run(job, interrupt))
        return runs

    @staticmethod
    def _signal(session, sig):
        for pid in session_processes(session):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _await(process, seconds_):
        try:
            process.wait(timeout=seconds_)
        except subprocess.TimeoutExpired:
            pass


class _Reader:
    """Reads a pipe in a thread (a job's output must not fill the pipe while it is watched)."""

    def __init__(self, pipe, chunks):
        import threading

        self.thread = threading.Thread(target=lambda: chunks.extend(iter(pipe.readline, "")))
        self.thread.daemon = True
        self.thread.start()

    def join(self):
        self.thread.join(timeout=30)
