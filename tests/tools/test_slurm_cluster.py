"""`minimal-fsdp cluster --scheduler slurm` without starting anything: what it says where SLURM is
missing, and the slurm.conf it writes (tests/multihost/test_slurm.py runs the real daemons)."""

import pytest

from minimal_fsdp.tools import slurm_cluster, virtual_cluster
from minimal_fsdp.tools.virtual_cluster import Host

from support import command


def test_missing_programs_are_named_with_the_package_to_install(monkeypatch):
    monkeypatch.setattr(slurm_cluster, "which", lambda name: None if name == "slurmd" else name)
    why = slurm_cluster.unavailable()
    assert why.startswith("slurmd not found") and "apt-get install slurm-wlm munge" in why


def test_the_command_refuses_in_one_line_where_slurm_is_missing(monkeypatch, capsys):
    """Refused before any host is made."""
    monkeypatch.setattr(virtual_cluster, "unavailable", lambda: None)
    monkeypatch.setattr(slurm_cluster, "unavailable", lambda: "slurmctld not found: install it")
    monkeypatch.setattr(virtual_cluster, "Cluster", None)  # would fail if reached
    with pytest.raises(SystemExit) as exited:
        command("cluster", one_line=False, *["--scheduler", "slurm", "--", "true"])
    assert exited.value.code == "error: --scheduler slurm: slurmctld not found: install it"


def test_the_config_names_every_host_and_keeps_every_file_in_the_state_folder(tmp_path):
    """The daemons share one file system: each slurmd's spool, PID and log file carry its node
    name (%n), and nothing is written outside the cluster's state folder."""
    hosts = [Host(f"node{i}", f"ns{i}", f"10.77.0.{i + 1}", f"p{i}") for i in range(3)]
    text = slurm_cluster.slurm_conf(tmp_path, hosts, 8, tmp_path / "munge.sock")
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    conf = dict(line.split("=", 1) for line in settings if " " not in line)
    assert "NodeName=node[0-2] NodeAddr=10.77.0.1,10.77.0.2,10.77.0.3 CPUs=8" in text
    assert conf["SlurmctldHost"] == "node0(10.77.0.1)"
    paths = {k: v for k, v in conf.items() if v.startswith("/")}
    assert {"StateSaveLocation", "SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"} <= set(paths)
    assert all(v.startswith(str(tmp_path)) for v in paths.values()), paths
    assert all("%n" in conf[k] for k in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"))
    assert conf["AuthInfo"].startswith(f"socket={tmp_path / 'munge.sock'}")
    one = slurm_cluster.slurm_conf(tmp_path, hosts[:1], 8, tmp_path / "munge.sock")
    assert "NodeName=node0 NodeAddr=10.77.0.1 " in one
