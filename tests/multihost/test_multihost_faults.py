"""The guard rails of a job across hosts (hosts as network namespaces,
minimal_fsdp.tools.virtual_cluster): an address that does not route between hosts, a
--checkpoint_dir on node-local disks, a link cut mid-run and a host killed mid-save. Each ends every
rank within a bound (generous: it only tells a stop from a hang) with one `error:` line and no
traceback, and the last good checkpoint resumes. Needs root (skipped elsewhere)."""

import sys
import time

import pytest
from test_multihost import WHY, Ranks, base_env, metrics, tiny_args, torchrun_env

from minimal_fsdp.checkpoint import find
from minimal_fsdp.tools.virtual_cluster import Cluster

from conftest import ROOT, make_text

pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no virtual hosts here: {WHY}")
FAULTS = ROOT / "tests" / "faults.py"
TIMEOUT = 20  # --collective_timeout of the runs that lose a peer


@pytest.fixture
def work(tmp_path):
    (tmp_path / "corpus.txt").write_text(make_text())
    return tmp_path


def start(cluster, work, args, entry=ROOT / "basic_training.py", **extra_env):
    """One rank on each of the two hosts, torchrun-style variables."""
    ranks = Ranks(cluster, work)
    for rank in range(2):
        env = base_env(**{**torchrun_env(rank, 0, rank, [1, 1]), **extra_env})
        ranks.start(f"node{rank}", [sys.executable, entry, *map(str, args)], env)
    return ranks


def one_line_each(results, code, starts):
    """Every rank exited `code`, none with a traceback; one `error:` line (starting with `starts`)
    from each rank, or from rank 0 alone where the ranks agreed on the failure and rank 0 speaks for
    all. Returns the lines."""
    lines = []
    for exit_code, out, err in results:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert exit_code == code and len(errors) <= 1 and "Traceback" not in err, (
            exit_code,
            err[-3000:],
        )
        assert all(line.startswith(starts) for line in errors), errors
        lines += errors
    assert len(lines) in (1, len(results)) and results[0][2].count("error: ") == 1, [
        r[2][-2000:] for r in results
    ]
    return lines


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["loopback interface", "no such interface", "loopback MASTER_ADDR"]
)
def test_an_address_that_does_not_route_between_hosts_ends_every_rank_at_once(work, case):
    env = {
        "loopback interface": {"GLOO_SOCKET_IFNAME": "lo"},
        "no such interface": {"GLOO_SOCKET_IFNAME": "ib0"},
        "loopback MASTER_ADDR": {"MASTER_ADDR": "127.0.0.1"},
    }[case]
    began = time.monotonic()
    with Cluster(2) as cluster:
        results = start(cluster, work, tiny_args(work, "net", 2), **env).wait(timeout=240)
    # without the check: a hang until --collective_timeout (300 s)
    assert time.monotonic() - began < 120
    lines = one_line_each(results, 2, "error: rank ")
    if case == "loopback MASTER_ADDR":
        assert all(
            "127.0.0.1 is this host's loopback" in line and "eth0 10.77.0." in line
            for line in lines
        )
    else:
        assert all(
            f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']}" in line and "eth0 10.77.0." in line
            for line in lines
        )


@pytest.mark.slow
def test_a_checkpoint_dir_on_node_local_disks_is_refused_before_training(work):
    with Cluster(2, node_local=work / "checkpoints") as cluster:
        results = start(cluster, work, tiny_args(work, "local", 2)).wait(timeout=240)
    lines = one_line_each(results, 2, "error:")
    assert any(
        "is not shared by every host: node1 cannot see the file rank 0 wrote there (on node0)"
        in line
        for line in lines
    ), lines
    assert not any("step 1" in out for _, out, _ in results)  # refused before training


def wait_for(path, seconds=240):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["link cut", "host killed mid-save"])
def test_a_lost_host_ends_every_rank_and_the_last_checkpoint_resumes(work, fault):
    """Step 2 is saved; then node1's link goes down while both ranks wait in step 4 (or node1 is
    killed while it writes its part of step 4): every rank ends within --collective_timeout and a
    margin, with one line; the next launch resumes from step 2."""
    args = tiny_args(work, "lost", 6, "--checkpoint_interval", 2, "--collective_timeout", TIMEOUT)
    release = work / "release"
    faults = "pause@4" if fault == "link cut" else "kill_in_save@4:1"
    with Cluster(2) as cluster:
        ranks = start(
            cluster,
            work,
            args,
            entry=FAULTS,
            MINIMAL_FSDP_FAULTS=faults,
            MINIMAL_FSDP_RELEASE=release,
        )
        if fault == "link cut":
            wait_for(work / "checkpoints" / "lost" / "step_2")
            time.sleep(2)  # both ranks are in step 4's pause
            cluster.cut("node1")
            release.touch()
        began = time.monotonic()
        results = ranks.wait(timeout=600)
        took = time.monotonic() - began
        assert took < TIMEOUT + 60, took
        one_line_each(results if fault == "link cut" else results[:1], 1, "error:")
        run = work / "checkpoints" / "lost"
        assert find.latest(run) == run / "step_2" and not (run / "step_4").exists()
        cluster.cut("node1", up=True)
        out = "".join(out for _, out, _ in start(cluster, work, args).wait(timeout=300))
    assert "resuming from" in out and "step_2" in out
    assert sorted({r["step"] for r in metrics(work, "lost") if "loss" in r}) == [1, 2, 3, 4, 5, 6]
