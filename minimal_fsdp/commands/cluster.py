"""`minimal-fsdp cluster [--hosts N] ... -- COMMAND`: virtual hosts on one machine, COMMAND run on
the first as a job script, then torn down (tools/virtual_cluster.py)."""

import sys

from minimal_fsdp.tools import virtual_cluster


def main(flags):
    """ClusterFlags -> the hosts, the command run on the first; exits with its exit code."""
    command = flags.command[1:] if flags.command[:1] == ["--"] else flags.command
    if not command:
        sys.exit("error: give the command after --")
    sys.exit(virtual_cluster.rehearse(flags, command))
