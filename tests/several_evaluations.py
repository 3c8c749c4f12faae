"""Run under mpiexec by test_evaluate.py (through conftest.launch_runs): several evaluations, one
after the other, on the same ranks, each `minimal-fsdp evaluate` with its own arguments
(minimal_fsdp.__main__.main), with process groups of its own, set up and torn down as in a launch
of its own. Python, torch and the harness start once.

argv[1] is a JSON file holding a list of argument lists; each has --output_path. What an evaluation
prints on each rank goes to stdout_<rank> and stderr_<rank> beside its --output_path (the
descriptors themselves are redirected, so the harness's and the libraries' lines land there too):
each evaluation's output reads as a launch of its own.
"""

import json
import os
import sys
from pathlib import Path

from minimal_fsdp.__main__ import main as cli
from minimal_fsdp.launch.discovery import MPI_RANK_VARIABLES


def redirected(folder, rank, argv):
    """`minimal-fsdp evaluate ARGV` with this rank's stdout and stderr in folder; a failure's
    output is then shown in the launch's stderr too, for the test's message."""
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            with open(folder / f"{name}_{rank}", "w") as f:
                os.dup2(f.fileno(), fd)
        cli(["evaluate", *argv])
    except BaseException:
        restore(saved)
        print((folder / f"stderr_{rank}").read_text()[-3000:], file=sys.stderr, flush=True)
        raise
    restore(saved)


def restore(saved):
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)


if __name__ == "__main__":
    rank = next(os.environ[name] for name in MPI_RANK_VARIABLES if name in os.environ)
    for argv in json.loads(Path(sys.argv[1]).read_text()):
        folder = Path(argv[argv.index("--output_path") + 1]).parent
        folder.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        redirected(folder, rank, argv)
