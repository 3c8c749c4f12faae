"""Gossip: the mixing matrices of every topology, and what gossip.py does with them, twice over. In one process,
ranks as threads with a small stand-in for torch.distributed (the calls gossip.py makes: all_reduce, all_gather,
batched isend/irecv): each step applies W_t and counts its bytes, the quadratic's rate, buffers, clipping and
misuse. Then real exchanges between 4 and 3 ranks over gloo (tests/gossip_ranks.py under mpiexec), checked the
same way: each step applies exactly W_t, complete gives the network average, and ring and exp drive replicas of a
quadratic toy problem to consensus at the rate the spectrum of W predicts."""
import json
import os
import queue
import subprocess
import sys
import threading

import pytest
import torch

import gossip_ranks
from conftest import ROOT, mpiexec
from minimal_fsdp.parallel import gossip
from minimal_fsdp.parallel.gossip import Gossip, TOPOLOGIES, exchange_for, exp_distances, mixing_matrix


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


WAIT = 10  # seconds: a mismatched exchange fails instead of hanging


class Done:
    def wait(self):
        pass


class Receive:
    def __init__(self, box, tensor):
        self.box, self.tensor = box, tensor

    def wait(self):
        self.tensor.copy_(self.box.get(timeout=WAIT))


class ThreadWorld:
    """torch.distributed as seen by `world` threads, thread i being rank i (only what gossip uses)."""
    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, world):
        self.world, self.local = world, threading.local()
        self.barrier = threading.Barrier(world, timeout=WAIT)
        self.slots = [None] * world
        self.boxes = {(i, j): queue.Queue() for i in range(world) for j in range(world)}

    def get_rank(self):
        return self.local.rank

    def get_world_size(self):
        return self.world

    def _everyone(self, tensor):
        """Every rank's tensor, once all have posted theirs."""
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        tensors = list(self.slots)
        self.barrier.wait()
        return tensors

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        assert op == self.ReduceOp.SUM, op  # the only one gossip uses
        tensor.copy_(torch.stack(self._everyone(tensor)).sum(0))
        return Done() if async_op else None

    def all_gather(self, out, tensor):
        for o, t in zip(out, self._everyone(tensor)):
            o.copy_(t)

    def isend(self, tensor, peer):
        self.boxes[self.local.rank, peer].put(tensor.clone())
        return Done()

    def irecv(self, tensor, peer):
        return Receive(self.boxes[peer, self.local.rank], tensor)

    class P2POp:
        def __init__(self, op, tensor, peer):
            self.op, self.tensor, self.peer = op, tensor, peer

    def batch_isend_irecv(self, ops):
        return [op.op(op.tensor, op.peer) for op in ops]

    def run(self, fn):
        """fn(rank) on every rank, each in its own thread; their results in rank order."""
        results, errors = [None] * self.world, []

        def rank_main(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: B036 (reported below, in the test's thread)
                errors.append(e)
                self.barrier.abort()
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def world(monkeypatch):
    def make(n):
        fake = ThreadWorld(n)
        monkeypatch.setattr(gossip, "dist", fake)
        monkeypatch.setattr(gossip_ranks, "dist", fake)
        return fake
    return make


@pytest.mark.parametrize("ranks", [4, 3, 2])
def test_each_step_applies_its_mixing_matrix_and_counts_its_bytes(world, ranks):
    fake = world(ranks)
    mixing = {t: fake.run(lambda rank: gossip_ranks.mixing_steps(t, rank, "cpu"))[0] for t in TOPOLOGIES}
    for topology in TOPOLOGIES:
        check_mixing({"world": ranks, "mixing": mixing}, topology)


@pytest.mark.parametrize("ranks", [4, 3])
def test_quadratic_in_threads_reaches_consensus_at_the_predicted_rate(world, ranks):
    fake = world(ranks)
    result = {"world": ranks, "lr": gossip_ranks.LR,
              "quadratic": {t: fake.run(lambda rank: gossip_ranks.quadratic(t, rank, gossip_ranks.LR, 12, "cpu"))[0]
                            for t in ("ring", "exp")}}
    for topology in ("ring", "exp"):
        check_quadratic(result, topology)


def test_one_buffer_per_incoming_message_reused_across_steps(world):
    fake = world(4)

    def steps(rank):
        g = Gossip(gossip_ranks.Replica(seed=rank), "alternating-exp-ring")
        counts = []
        for step in range(4):  # exp (1 message in), ring (2 in), exp, ring
            g.start(step)
            g.finish()
            counts.append(len(g.received))
        return counts, g.received
    for counts, buffers in fake.run(steps):
        assert counts == [1, 2, 2, 2] and all(b.shape == buffers[0].shape for b in buffers)


def test_receives_are_posted_before_sends(world, monkeypatch):
    """On gloo, an exchange posted sends-first moved at half a shaped link's rate in about half the tries, and
    receives-first at its rate every time (docs/performance.md): every step posts its receives first."""
    fake = world(4)
    posted = []
    batch = fake.batch_isend_irecv
    monkeypatch.setattr(fake, "batch_isend_irecv", lambda ops: posted.append([op.op for op in ops]) or batch(ops))

    def steps(rank):
        g = Gossip(gossip_ranks.Replica(seed=rank), "alternating-exp-ring")
        for step in range(4):  # exp (one message each way), ring (two)
            g.start(step)
            g.finish()
    fake.run(steps)
    assert len(posted) == 16 and {len(ops) for ops in posted} == {2, 4}
    for ops in posted:
        assert ops == sorted(ops, key=lambda op: op != fake.irecv), ops  # every irecv before any isend


def test_clip_grad_norm_clips_this_replica_and_returns_the_mean_norm(world):
    fake = world(2)

    def clip(rank, max_norm):
        model = gossip_ranks.Replica(seed=rank, dtype=torch.float64)
        g = Gossip(model, "ring")
        for p in model.parameters():
            p.grad = torch.full_like(p, 3.0 * (rank + 1))  # 17 elements: norm 3 * (rank + 1) * sqrt(17)
        norm = g.clip_grad_norm(model.parameters(), max_norm)
        return norm.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    own = [3 * 17 ** 0.5, 6 * 17 ** 0.5]
    for norm, after in fake.run(lambda rank: clip(rank, 1.0)):
        assert norm == pytest.approx(sum(own) / 2) and after == pytest.approx(1.0)
    for max_norm in (None, 0.0):  # no --grad_clip: gradients untouched
        results = fake.run(lambda rank: clip(rank, max_norm))
        assert [after for _, after in results] == pytest.approx(own)
        assert [norm for norm, _ in results] == pytest.approx([sum(own) / 2] * 2)


def test_a_nonfinite_grad_norm_on_one_replica_reaches_every_rank(world):
    fake = world(3)

    def clip(rank):
        model = gossip_ranks.Replica(seed=rank)
        g = Gossip(model, "exp")
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan") if rank == 1 else 1.0)
        return g.clip_grad_norm(model.parameters(), 1.0).item()
    assert all(norm != norm for norm in fake.run(clip))  # NaN everywhere: every rank skips or stops together


def test_one_rank_gossip_leaves_parameters_alone(world):
    fake = world(1)

    def steps(rank):
        model = gossip_ranks.Replica(seed=3)
        before = model.vector().clone()
        g = Gossip(model, "complete")
        for step in range(3):
            g.start(step)
            g.finish()
        return before, model.vector(), g.bytes_sent, g.consensus_distance()
    ((before, after, sent, distance),) = fake.run(steps)
    assert torch.equal(before, after) and sent == 0 and distance == 0.0


def test_parameters_become_views_of_one_flat_buffer(world):
    fake = world(1)

    def build(rank):
        model = gossip_ranks.Replica(seed=0)
        model.scale = torch.nn.Parameter(torch.tensor([2.0, 3.0]))  # three parameters: offsets add up
        values = model.vector().clone()
        g = Gossip(model, "ring")
        assert torch.equal(g.flat, values)  # the same values, in parameter order
        g.flat.add_(1.0)
        return values, model.vector()
    ((values, through_model),) = fake.run(build)
    assert torch.equal(through_model, values + 1)


def test_misuse_is_refused(world):
    fake = world(1)

    def refuse(rank):
        with pytest.raises(ValueError, match="^unknown topology 'star'; choose from complete, ring, exp, "
                                             "alternating-exp-ring$"):
            Gossip(gossip_ranks.Replica(seed=0), "star")
        mixed = gossip_ranks.Replica(seed=0)
        mixed.bias.data = mixed.bias.data.double()
        with pytest.raises(ValueError, match="^gossip needs every parameter on one device with one dtype$"):
            Gossip(mixed, "ring")
        frozen = gossip_ranks.Replica(seed=0)
        frozen.bias.requires_grad_(False)
        assert Gossip(frozen, "ring").flat.numel() == 12  # only trained parameters travel
        g = Gossip(gossip_ranks.Replica(seed=0), "ring")
        g.start(0)
        with pytest.raises(AssertionError, match="^gossip start\\(\\) twice without finish\\(\\)$"):
            g.start(1)
    fake.run(refuse)
    with pytest.raises(ValueError, match="^unknown topology 'star'; choose from complete, ring, exp, "
                                         "alternating-exp-ring$"):
        gossip.exchange_for("star", 0, 4, 0)
