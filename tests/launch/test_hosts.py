"""hosts.py's decisions, in-process (no namespaces, no root): which address MPI's rank 0 offers,
which interface a job across hosts uses, and the one-line errors for interfaces other hosts cannot
reach."""

import ipaddress

import pytest

from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.launch import hosts

LOCAL = {
    "lo": ipaddress.IPv4Interface("127.0.0.1/8"),
    "eth0": ipaddress.IPv4Interface("10.1.0.5/16"),
    "ib0": ipaddress.IPv4Interface("192.168.7.5/24"),
}


def test_rank_0_offers_its_address_on_the_network_every_host_shares():
    everyone = [
        ("n0", ["172.17.0.1/16", "10.1.0.5/16", "192.168.7.5/24"]),
        # a second rank of rank 0's host
        ("n0", ["172.17.0.1/16", "10.1.0.5/16", "192.168.7.5/24"]),
        # docker's bridge everywhere, the same address: useless
        ("n1", ["172.17.0.1/16", "10.1.0.6/16"]),
        ("n2", ["10.1.3.9/16", "192.168.7.9/24"]),
    ]
    assert hosts.reachable_address(everyone) == "10.1.0.5"
    # docker's bridge alone in common: not taken
    assert hosts.reachable_address(everyone[:3]) == "10.1.0.5"
    # no network in common with any other host: the best it has, else its hostname
    assert hosts.reachable_address([("n0", ["10.9.0.1/24"]), ("n1", ["10.8.0.1/24"])]) == "10.9.0.1"
    assert hosts.reachable_address([("n0", []), ("n1", ["10.8.0.1/24"])]) == "n0"


@pytest.fixture
def interfaces(monkeypatch):
    monkeypatch.setattr(hosts, "interfaces", lambda: dict(LOCAL))
    monkeypatch.setattr(
        hosts,
        "route_source",
        lambda address: (
            "127.0.0.1"
            if address.startswith("127.")
            else "192.168.7.5"
            if address.startswith("192.168.7.")
            else "10.1.0.5"
        ),
    )


def test_the_interface_on_the_route_to_rank_0_is_picked_and_exported(interfaces):
    env = {}
    # one host: nothing to pick
    assert hosts.pick_interface("10.1.0.1", 1, env) is None and env == {}
    line = hosts.pick_interface("10.1.0.1", 2, env)
    assert env == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert line.startswith("network: eth0 (10.1.0.5), the route to 10.1.0.1")
    env = {"NCCL_SOCKET_IFNAME": "hsn0"}  # the user's NCCL choice stays
    hosts.pick_interface("192.168.7.1", 4, env)
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "hsn0"}


def test_nccl_gets_socket_threads_on_several_hosts_unless_set():
    # NCCL over TCP at the link's rate
    sockets = {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "4"}
    env = {}
    hosts.nccl_socket_threads(1, env)
    assert env == {}  # one host: NCCL's own transports
    hosts.nccl_socket_threads(2, env)
    assert env == sockets
    env = {"NCCL_NSOCKS_PERTHREAD": "8"}  # the user's choice stays
    hosts.nccl_socket_threads(4, env)
    assert env == {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "8"}


def test_interfaces_other_hosts_cannot_reach_are_one_line_errors(interfaces):
    assert (
        hosts.pick_interface("10.1.0.1", 2, {"GLOO_SOCKET_IFNAME": "ib0"})
        == "network: gloo over GLOO_SOCKET_IFNAME=ib0 (as set)"
    )
    for given in ("lo", "eth7", "eth0,lo"):
        with pytest.raises(
            ConfigError,
            match=f"GLOO_SOCKET_IFNAME={given} on .*is not an interface that other hosts "
            r"can reach \(here: lo 127.0.0.1, eth0 10.1.0.5, ib0 192.168.7.5\)",
        ):
            hosts.pick_interface("10.1.0.1", 2, {"GLOO_SOCKET_IFNAME": given})
    with pytest.raises(
        ConfigError,
        match="the rendezvous address 127.0.0.1 is this host's loopback, but the job spans "
        "2 hosts: export MASTER_ADDR",
    ):
        hosts.pick_interface("127.0.0.1", 2, {})
    with pytest.raises(
        ConfigError, match="no route from .* to the rendezvous address no-such-host.invalid"
    ):
        hosts.pick_interface("no-such-host.invalid", 2, {})


def test_this_machines_interfaces_are_read():
    found = hosts.interfaces()
    assert found["lo"].ip == ipaddress.IPv4Address("127.0.0.1")
    assert hosts.route_source("127.0.0.1") == "127.0.0.1"


def test_shared_checkpoint_dir_probe_leaves_nothing_and_names_an_unwritable_dir(
    one_rank_group, tmp_path
):
    """One rank (it sees its own file): the check passes and removes its probe; a --checkpoint_dir
    rank 0 cannot write is one line. The node-local case, across hosts, is
    tests/multihost/test_multihost_faults.py's."""
    hosts.check_shared_dir(tmp_path / "checkpoints", num_nodes=2)
    assert list((tmp_path / "checkpoints").iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ConfigError, match="--checkpoint_dir .*file/checkpoints: rank 0 cannot write there"
    ):
        hosts.check_shared_dir(tmp_path / "file" / "checkpoints", num_nodes=2)


def test_hosts_sharing_a_hostname_are_told_apart_by_their_ranks():
    """Two hosts named node0: the one that cannot see rank 0's file is named by its ranks, not as
    node0 alone (which read as 'node0 cannot see the file ... (on node0)')."""
    verdicts = [
        ("node0", True),
        ("node0", True),
        ("node0", False),
        ("node0", False),
        ("node1", False),
    ]
    assert (
        hosts.blind_hosts(verdicts)
        == "ranks 2, 3 on node0 (a hostname another host also has), node1"
    )
    assert hosts.blind_hosts([("node0", True), ("node1", False)]) == "node1"
    assert hosts.blind_hosts([("node0", True), ("node1", True)]) == ""
