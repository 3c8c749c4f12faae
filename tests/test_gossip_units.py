"""Gossip's exchanges in one process: ranks are threads, and a small stand-in for torch.distributed (the calls
gossip.py makes: all_reduce, all_gather, batched isend/irecv) passes tensors between them. The same checks as
test_gossip.py's mpiexec run (each step applies W_t, bytes sent, consensus distance, the quadratic's rate), in
a second, plus clipping and misuse. The real transport (gloo, NCCL) stays test_gossip.py's."""
import queue
import threading

import pytest
import torch

import gossip_ranks
from minimal_fsdp import gossip
from minimal_fsdp.gossip import TOPOLOGIES, Gossip
from test_gossip import check_mixing, check_quadratic

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
def test_quadratic_reaches_consensus_at_the_predicted_rate(world, ranks):
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
