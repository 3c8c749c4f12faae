"""Gossip: the mixing matrices of every topology (in process), and real exchanges between 4 and 3 ranks over
gloo checked against them: each step applies exactly W_t, complete gives the network average, and ring and
exp drive replicas of a quadratic toy problem to consensus at the rate the spectrum of W predicts."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, mpiexec

sys.path.insert(0, str(ROOT))
from minimal_fsdp.gossip import TOPOLOGIES, exchange_for, exp_distances, mixing_matrix  # noqa: E402


def period(topology, world):
    """Steps after which a topology's sequence of mixing matrices repeats."""
    exp = max(1, len(exp_distances(world)))
    return {"exp": exp, "alternating-exp-ring": 2 * exp}.get(topology, 1)


@pytest.mark.parametrize("world", range(1, 10))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_mixing_is_doubly_stochastic_and_sends_match_receives(topology, world):
    for step in range(2 * period(topology, world)):
        w = mixing_matrix(topology, world, step)
        assert (w >= 0).all()
        ones = torch.ones(world, dtype=torch.float64)
        torch.testing.assert_close(w.sum(dim=1), ones)  # a weighted average on every rank
        torch.testing.assert_close(w.sum(dim=0), ones)  # ... that keeps the network average
        for rank in range(world):
            sends = set(exchange_for(topology, rank, world, step).send_to)
            receivers = {j for j in range(world)
                         if rank in [peer for peer, _ in exchange_for(topology, j, world, step).recv_from]}
            assert sends == receivers, (step, rank)  # every message posted has a matching receive


def test_topology_shapes():
    assert exp_distances(4) == [1, 2] and exp_distances(5) == [1, 2, 4] and exp_distances(1) == []
    ring = exchange_for("ring", 0, 6, 0)
    assert set(ring.send_to) == {1, 5} and ring.self_weight == pytest.approx(1 / 3)
    assert [exchange_for("exp", 0, 6, s).send_to for s in range(4)] == [(1,), (2,), (4,), (1,)]
    alternating = [exchange_for("alternating-exp-ring", 0, 8, s).send_to for s in range(6)]
    assert alternating == [(1,), (7, 1), (2,), (7, 1), (4,), (7, 1)]
    with pytest.raises(ValueError, match="unknown topology"):
        exchange_for("star", 0, 4, 0)


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_exp_averages_exactly_in_log2_world_steps(world):
    product = torch.eye(world, dtype=torch.float64)
    for step in range(len(exp_distances(world))):
        product = mixing_matrix("exp", world, step) @ product
    torch.testing.assert_close(product, torch.full((world, world), 1 / world, dtype=torch.float64))


@pytest.mark.parametrize("world", [3, 5, 8, 12])
def test_ring_spectrum(world):
    j = torch.arange(world, dtype=torch.float64)
    expected = (1 + 2 * torch.cos(2 * torch.pi * j / world)) / 3
    eigenvalues = torch.linalg.eigvalsh(mixing_matrix("ring", world, 0))
    torch.testing.assert_close(eigenvalues, expected.sort().values)


def predicted_rate(topology, world, lr):
    """Per-step contraction of the distance to consensus for x <- W_t x - lr (x - b): the spectral radius of
    the period's product of (W_t - lr I) on the space orthogonal to consensus, to the power 1/period."""
    p = period(topology, world)
    eye = torch.eye(world, dtype=torch.float64)
    product = eye
    for step in range(p):
        product = (mixing_matrix(topology, world, step) - lr * eye) @ product
    off_consensus = eye - torch.full((world, world), 1 / world, dtype=torch.float64)
    radius = torch.linalg.eigvals(product @ off_consensus).abs().max().item()
    return radius ** (1 / p), p


def run_gossip_ranks(ranks, out):
    """tests/gossip_ranks.py on `ranks` MPI ranks; returns its JSON result."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(ROOT / "tests" / "gossip_ranks.py"), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[4, 3], ids=["4 ranks", "3 ranks"])
def ranks_result(request, tmp_path_factory):
    return run_gossip_ranks(request.param, tmp_path_factory.mktemp("gossip") / "result.json")


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_each_gossip_step_applies_its_mixing_matrix(ranks_result, topology):
    check_mixing(ranks_result, topology)


@pytest.mark.parametrize("topology", ["ring", "exp"])
def test_quadratic_reaches_consensus_at_the_predicted_rate(ranks_result, topology):
    check_quadratic(ranks_result, topology)


def check_mixing(ranks_result, topology):
    world = ranks_result["world"]
    run = ranks_result["mixing"][topology]
    for step, record in enumerate(run["steps"]):
        before = torch.tensor(record["before"], dtype=torch.float64)
        after = torch.tensor(record["after"], dtype=torch.float64)
        torch.testing.assert_close(after, mixing_matrix(topology, world, step) @ before, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(after.mean(0), before.mean(0), atol=1e-6, rtol=1e-6)  # average kept
        if topology == "complete":  # exactly the network average on every rank
            torch.testing.assert_close(after, before.mean(0).expand_as(after), atol=1e-6, rtol=1e-6)
        consensus = (after - after.mean(0)).square().sum(1).mean().item()
        assert record["consensus"] == pytest.approx(consensus, rel=1e-4, abs=1e-9)
    # One fp32 message per peer per step: what a rank sent over the run.
    nbytes = run["numel"] * 4
    expected = sum(len(exchange_for(topology, 0, world, s).send_to) for s in range(len(run["steps"]))) * nbytes
    if topology == "complete":
        expected = len(run["steps"]) * round(2 * (world - 1) / world * nbytes)
    assert run["bytes_sent"] == expected


def check_quadratic(ranks_result, topology):
    world, lr = ranks_result["world"], ranks_result["lr"]
    distances = ranks_result["quadratic"][topology]
    rate, p = predicted_rate(topology, world, lr)
    assert 0 < rate < 1
    measured = (distances[-1] / distances[-1 - p]) ** (1 / (2 * p))  # distances are squared norms
    assert measured == pytest.approx(rate, rel=0.02), (distances, rate)
    assert distances[-1] < 1e-6 * distances[0]


def test_exp_without_gradient_steps_is_exact_averaging_for_powers_of_two(ranks_result):
    world = ranks_result["world"]
    distances = ranks_result["exp_no_lr"]
    steps = len(exp_distances(world))
    if world & (world - 1) == 0:
        assert distances[steps] < 1e-20 * distances[0]  # consensus after log2(world) steps
    else:
        rate, p = predicted_rate("exp", world, 0.0)
        assert distances[p] / distances[0] <= rate ** (2 * p) * (1 + 1e-9)
        assert distances[p] > 1e-3 * distances[0]  # not exact: the one-peer graph needs 2^k ranks for that
