"""Stand-ins for a cluster's commands (srun, sbatch, squeue; PBS's qsub and qstat are in
fake_pbs.py), put first on PATH by the launcher tests, and `run_session`, which runs a command in a
session of its own and proves that no process of it is left behind."""

import os
import subprocess
import sys
import time
from pathlib import Path

FAKE_SRUN = """#!{python}
# srun: starts SLURM_NTASKS copies of the command on this host with srun's task variables. \
FAKE_TASKS_PER_NODE
# (e.g. 2,1,1) spreads the tasks over pretend nodes; --mpi=pmix adds the variables of srun's PMIx \
plugin;
# --kill-on-bad-exit=1 kills the other tasks when one fails. Its argv goes to FAKE_SRUN_LOG.
import json, os, subprocess, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
options = []
while args[0].startswith("-"):
    options.append(args.pop(0))
n = int(os.environ["SLURM_NTASKS"])
per_node = [int(c) for c in os.environ.get("FAKE_TASKS_PER_NODE", str(n)).split(",")]
job = os.environ["SLURM_JOB_ID"]
tasks = []
for node, count in enumerate(per_node):
    for local in range(count):
        env = dict(os.environ, SLURM_PROCID=str(len(tasks)), SLURM_LOCALID=str(local), \
SLURM_NODEID=str(node),
                   SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(n), \
SLURM_STEP_NUM_NODES=str(len(per_node)),
                   SLURM_STEP_TASKS_PER_NODE=",".join(map(str, per_node)),
                   SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"])
        if "--mpi=pmix" in options:
            env.update(PMIX_RANK=str(len(tasks)), PMIX_NAMESPACE=f"slurm.pmix.{{job}}.0")
        tasks.append(subprocess.Popen(args, env=env))
codes = {{}}
while len(codes) < len(tasks):
    for i, task in enumerate(tasks):
        if i not in codes and task.poll() is not None:
            codes[i] = task.returncode
            if task.returncode and "--kill-on-bad-exit=1" in options:
                for other in tasks:
                    if other.poll() is None:
                        other.kill()
    time.sleep(0.1)
sys.exit(next((c for c in codes.values() if c), 0))
"""

# sbatch puts the job in FAKE_QUEUE (one JSON file per job, argv and the id given) and prints
# its id; the test runs the queued jobs one after the other, as the scheduler would.
FAKE_SUBMIT = """#!{python}
import json, os, sys
from pathlib import Path
queue = Path(os.environ["FAKE_QUEUE"])
number = len(list(queue.glob("*.json"))) + 2  # the first job, started by the test, is 1
job_id = "{id_format}".format(number)
(queue / f"{{number:03d}}.json").write_text(json.dumps({{"argv": sys.argv[1:], "id": job_id}}))
print({printed!r}.format(job_id))
"""

FAKE_SQUEUE = """#!/bin/bash
# squeue -h -j JOBID -o "%l %L": the job's time limit and time left.
echo "${FAKE_TIME_LIMIT:-1:00:00} ${FAKE_TIME_LEFT:-58:30}"
"""


def install_fakes(bin_dir, queue_dir=None):
    """Writes the stand-ins into bin_dir; returns the environment that puts them first on PATH."""
    bin_dir.mkdir(exist_ok=True)
    python = sys.executable
    scripts = {
        "srun": FAKE_SRUN.format(python=python),
        "squeue": FAKE_SQUEUE,
        "sbatch": FAKE_SUBMIT.format(
            python=python, id_format="{}", printed="Submitted batch job {}"
        ),
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{Path(python).parent}:{os.environ['PATH']}",
        "FAKE_SRUN_LOG": str(bin_dir / "srun.log"),
    }
    if queue_dir is not None:
        queue_dir.mkdir(exist_ok=True)
        env["FAKE_QUEUE"] = str(queue_dir)
    return env


def session_processes(session):
    """Live (not zombie) processes of a session."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == session and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def run_session(cmd, env, cwd, timeout=240, linger=60):
    """Run cmd in a new session; returns the CompletedProcess. Asserts that every process of the
    session has exited within `linger` seconds of the command's end, and kills whatever is left (the
    test then fails). The timeouts only catch a hang; nothing here measures time."""
    process = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
        deadline = time.monotonic() + linger
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = session_processes(process.pid)
    finally:
        for pid in session_processes(process.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert not left, f"processes left behind: {left}\n{err[-3000:]}"
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]
